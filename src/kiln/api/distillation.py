"""Which teachers an RLJob's on-policy distillation (`rl.advantage: opd`) stages learn from.

A stage names one teacher for all its task sets (`rl.teacher`) or one per group of task sets
(`rl.teachers`: e.g. an earlier stage's final weights for the skill that stage taught, another's
for another skill). A teacher is an earlier stage's name or a checkpoint directory. The job's
distinct teachers, in order of first mention (`teacher_refs`), are what `kiln run` serves, one
process each; the index of a teacher in that list is how rollout finds it
(`KILN_TEACHER_ADDR` for the first, `KILN_TEACHER_<i>_ADDR` for the others). Torch-free.
"""
from __future__ import annotations


def stage_teachers(stage) -> list[tuple[str, list[str]]]:
    """(teacher, task sets it scores) of an opd stage, or (reference, all its task sets) of an
    RL stage with a KL penalty (`rl.klCoef`, `rl.reference`: scored the same way); [] for any
    other stage."""
    rl = getattr(stage, "rl", None)
    if rl is not None and rl.reference:
        return [(rl.reference, list(stage.tasks))]
    if rl is None or rl.advantage != "opd":
        return []
    if rl.teacher:
        return [(rl.teacher, list(stage.tasks))]
    return [(t.teacher, list(t.tasks)) for t in rl.teachers]


def teacher_refs(spec) -> list[str]:
    """The job's distinct frozen deployments: its teachers, in order of first mention, then its
    swarm stages' subagents (served the same way, answering Generate rather than Score), then
    its task sets' reward models (`rewardRules.outcomeModel` scores, `rewardRules.judge`
    generates)."""
    refs = [ref for stage in spec.stages for ref, _ in stage_teachers(stage)]
    refs += [stage.swarm.subagents for stage in spec.stages if getattr(stage, "swarm", None)]
    refs += [ref for ts in spec.tasks if ts.reward_rules for ref in ts.reward_rules.models()]
    return list(dict.fromkeys(refs))


def teacher_process(index: int) -> str:
    """The local process (and address variable stem) of the job's `index`-th teacher."""
    return "teacher" if index == 0 else f"teacher_{index}"


def teacher_problems(spec) -> list[str]:
    """Why the job's teachers are not servable: a stage named that does not come earlier, or
    an opd stage's task sets not taught exactly once."""
    names = [s.name for s in spec.stages]
    problems = []
    for ts in spec.tasks:
        # A reward model made by a stage must be done before any RL stage samples the task set
        # (SFT and evaluation do not ask reward models).
        for ref in ts.reward_rules.models() if ts.reward_rules else []:
            users = [i for i, s in enumerate(spec.stages)
                     if ts.name in s.tasks and getattr(s, "rl", None) is not None]
            if ref in names and users and names.index(ref) >= users[0]:
                problems.append(f"tasks {ts.name}: rewardRules model {ref!r} names a stage that "
                                f"does not come before stages[{users[0]}] "
                                f"({spec.stages[users[0]].name}), the first to sample the task set")
    for i, stage in enumerate(spec.stages):
        taught: list[str] = []
        for ref, tasks in stage_teachers(stage):
            if ref in names and names.index(ref) >= i:
                field = "reference" if stage.rl.reference else "teacher"
                problems.append(f"stages[{i}] ({stage.name}): rl.{field} {ref!r} names a stage "
                                "that does not come before this one")
            taught += tasks
        if not stage_teachers(stage):
            continue
        stray = sorted(set(taught) - set(stage.tasks))
        twice = sorted({t for t in taught if taught.count(t) > 1})
        untaught = sorted(set(stage.tasks) - set(taught))
        for what, which in (("are not tasks of the stage", stray), ("have two teachers", twice),
                            ("have no teacher", untaught)):
            if which:
                problems.append(f"stages[{i}] ({stage.name}): rl.teachers: task sets {which} {what}")
    return problems
