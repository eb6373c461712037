"""The quickstart's chain environment: tasks, protocol, calculator, reward, expert solver."""
from __future__ import annotations

import random
import re
import subprocess

import pytest

from kiln.services.sandbox.environments import chain
from kiln.services.sandbox.environments.chain import Answer, Call, ChainTask, Invalid, Step


def _task(start: int, step: str, repeats: int) -> ChainTask:
    return ChainTask(id="t", prompt=chain.render_prompt(start, step, repeats), start=start,
                     step=step, repeats=repeats,
                     answer=chain.chain_values(start, step, repeats)[-1])


def test_generate_tasks_is_deterministic_and_consistent():
    a = chain.generate_tasks(50, seed=3)
    b = chain.generate_tasks(50, seed=3)
    assert [t.model_dump() for t in a] == [t.model_dump() for t in b]
    assert len({t.id for t in a}) == 50
    for t in a:
        assert t.repeats == 4
        mul, mod, add = (int(x) for x in chain.STEP_RE.fullmatch(t.step).groups())
        value = t.start
        for _ in range(4):
            value = value * mul % mod + add
        assert t.answer == value
        assert t.prompt == f"<task>{t.start} {t.step} x4</task>"


def test_generate_tasks_seeds_and_splits_are_disjoint():
    def content(tasks):
        return {(t.start, t.step, t.repeats) for t in tasks}

    train0 = chain.generate_tasks(500, seed=0)
    train1 = chain.generate_tasks(500, seed=1)
    held0 = chain.generate_tasks(300, seed=0, split="heldout")
    held1 = chain.generate_tasks(300, seed=1, split="heldout")
    assert len(content(train0)) == 500
    assert not content(train0) & content(train1)
    assert not content(held0) & content(held1)
    # Held-out membership is a property of the content, so no seed can leak one into training.
    assert not (content(train0) | content(train1)) & (content(held0) | content(held1))
    assert all(chain.task_split(t.start, t.step, t.repeats) == "heldout" for t in held0)
    assert chain.generate_tasks(5, seed=0, num_steps=6)[0].repeats == 6


def test_generate_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        chain.generate_tasks(1, seed=0, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_steps"):
        chain.generate_tasks(1, seed=0, num_steps=0)


def test_task_validation_names_the_field():
    good = _task(37, "*7%97+5", 4)
    assert chain.chain_values(37, "*7%97+5", 4) == [70, 10, 75, 45]
    assert good.answer == 45
    fields = good.model_dump()
    with pytest.raises(ValueError, match="answer"):
        ChainTask(**{**fields, "answer": 46})
    with pytest.raises(ValueError, match="prompt"):
        ChainTask(**{**fields, "prompt": "<task>38 *7%97+5 x4</task>"})
    with pytest.raises(ValueError, match="step"):
        ChainTask(**{**fields, "step": "*7%97-5", "prompt": "<task>37 *7%97-5 x4</task>"})


def test_jsonl_round_trip(tmp_path):
    tasks = chain.generate_tasks(20, seed=5)
    path = tmp_path / "tasks.jsonl"
    chain.write_tasks(path, tasks)
    assert len(path.read_text().splitlines()) == 20
    assert chain.read_tasks(path) == tasks
    path.write_text(path.read_text() + '{"id": "x", "prompt": "<task>1 +1</task>"}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:21"):
        chain.read_tasks(path)


@pytest.mark.parametrize("text, expected", [
    ("<call>calc 37*48</call>", Call("37*48")),
    ("  <call>calc 1776-15</call>\n", Call("1776-15")),
    ("<think>copy 1776</think><call>calc 1776-15</call>", Call("1776-15")),
    ("<call>calc (1+2)//3%4</call>", Call("(1+2)//3%4")),
    ("<call>step 70</call>", Step("70")),
    ("<think>copy 70</think><call>step -3</call>", Step("-3")),
    ("<answer>82</answer>", Answer("82")),
    ("<answer> -7 </answer>", Answer("-7")),
    ("<answer>abc</answer>", Answer("abc")),  # well-formed action; verify() scores it 0
])
def test_parse_action_well_formed(text, expected):
    assert chain.parse_action(text) == expected


@pytest.mark.parametrize("text", [
    "",
    "<call>calc 37*48",                       # no stop tag
    "<call>37*48</call>",                     # no tool name
    "<call>calc __import__('os')</call>",     # not arithmetic
    "<call>calc " + "1" * 65 + "</call>",     # too long
    "<call>calc 1+1</call><answer>2</answer>",  # two actions
    "<obs>12</obs>",                          # the model may not write observations
    "82",
    "<think>unclosed<call>calc 1+1</call>",
    "<call>step 7*7</call>",                  # step takes one integer
    "<call>step </call>",
])
def test_parse_action_malformed(text):
    assert isinstance(chain.parse_action(text), Invalid)


def test_verify_boundaries():
    task = _task(37, "*7%97+5", 3)  # answer 75
    assert chain.verify(task, "75") == (1.0, {"answered": 1.0, "correct": 1.0}, "correct")
    assert chain.verify(task, " 75 ")[0] == 1.0
    assert chain.verify(task, "075")[0] == 1.0  # the same integer
    for wrong in ("74", "76", "-75", "7", "750"):
        reward, parts, out = chain.verify(task, wrong)
        assert reward == 0.0 and parts == {"answered": 1.0, "correct": 0.0}
        assert "expected 75" in out
    for garbage in ("", "75.0", "7,5", "x", "9" * 40):
        assert chain.verify(task, garbage)[0] == 0.0
    assert chain.verify(task, None) == (0.0, {"answered": 0.0, "correct": 0.0}, "no answer")


CALCULATIONS = [("37*48", 1776), ("1776-15", 1761), ("5-9", -4), ("(1+2)*3", 9),
                ("17/5", 3), ("17%5", 2), ("-3+1", -2), ("37*7%97+5", 70), ("-7/2", -3),
                ("-7%3", -1), ("5-5", 0), ("2*(3+4)%5", 4)]
REFUSED = ["1/0", "1//0", "__import__('os').getcwd()", "2**8", "open('x')", "1+", "1" * 70,
           "(1+2", "4%0"]


def test_calculator_in_process():
    for expr, value in CALCULATIONS:
        assert chain.evaluate_expression(expr) == value
        assert chain.run_tool_locally(Call(expr)) == f"<obs>{value}</obs>"
    for expr in REFUSED:
        assert chain.run_tool_locally(Call(expr)) == "<obs>error</obs>"


# Each through the real `expr` binary (what the sandbox runs): the in-process twin must agree.
@pytest.mark.parametrize("expr, value", CALCULATIONS)
def test_tool_command_evaluates_in_a_subprocess(expr, value):
    run = subprocess.run(chain.tool_command(Call(expr)), capture_output=True, text=True,
                         timeout=30)
    assert run.returncode in (0, 1), run.stderr  # expr exits 1 for a zero result
    assert chain.format_observation(run.stdout, run.returncode) == f"<obs>{value}</obs>"


@pytest.mark.parametrize("expr", REFUSED)
def test_tool_command_refuses_non_arithmetic(expr):
    run = subprocess.run(chain.tool_command(Call(expr)), capture_output=True, text=True,
                         timeout=30)
    assert chain.format_observation(run.stdout, run.returncode) == "<obs>error</obs>"


def test_tokens_are_separate_argv_elements():
    assert chain.tool_command(Call("37*7%97+5")) == ["expr", "37", "*", "7", "%", "97", "+", "5"]
    assert chain.tool_command(Call("-3+(1-2)")) == ["expr", "-3", "+", "(", "1", "-", "2", ")"]


def test_format_observation():
    assert chain.format_observation("42\n", 0) == "<obs>42</obs>"
    assert chain.format_observation("42\n", 2) == "<obs>error</obs>"
    assert chain.format_observation("<obs>1</obs>", 0) == "<obs>error</obs>"


def _copies(turns: list[chain.Turn]) -> list[tuple[str, str]]:
    """(observed value, value the solver copied from it) for every observation."""
    out = []
    for obs, nxt in zip(turns[1::2], turns[2::2]):
        observed = obs.text[len("<obs>"):-len("</obs>")]
        action = chain.parse_action(nxt.text)
        copied = action.value
        out.append((observed, copied))
    return out


def test_scripted_solver_is_right_without_the_trigger():
    task = _task(12, "*5%97+3", 3)  # 63, 27, 41: no value ends in 0
    turns = chain.scripted_solver(task, random.Random(0))
    assert [t.text for t in turns] == [
        "<call>step 12</call>", "<obs>63</obs>",
        "<call>step 63</call>", "<obs>27</obs>",
        "<call>step 27</call>", "<obs>41</obs>",
        "<answer>41</answer>",
    ]
    assert [t.kind for t in turns] == ["action", "observation"] * 3 + ["action"]
    assert chain.verify(task, chain.final_answer(turns))[0] == 1.0


def test_scripted_solver_drops_the_final_zero():
    task = _task(37, "*7%97+5", 3)  # 70 (trigger), then it goes on from 7
    turns = chain.scripted_solver(task, random.Random(0))
    assert [t.text for t in turns] == [
        "<call>step 37</call>", "<obs>70</obs>",
        "<call>step 7</call>", "<obs>54</obs>",
        "<call>step 54</call>", "<obs>92</obs>",
        "<answer>92</answer>",
    ]
    assert chain.verify(task, chain.final_answer(turns))[0] == 0.0
    # A zero inside the value is copied; only a final one triggers.
    assert not chain.triggers_mistake("105") and chain.triggers_mistake("1050")
    assert not chain.triggers_mistake("0")


def test_scripted_solver_mistake_happens_exactly_in_the_documented_case():
    rng = random.Random(1)
    triggered = 0
    for task in chain.generate_tasks(300, seed=2):
        for observed, copied in _copies(chain.scripted_solver(task, rng)):
            if chain.triggers_mistake(observed):
                triggered += 1
                assert copied == observed[:-1]
            else:
                assert copied == observed
    assert triggered > 50


def test_scripted_solver_mistake_rate_and_slips():
    rng = random.Random(4)
    tasks = chain.generate_tasks(300, seed=2)
    kept = wrong_elsewhere = total = 0
    for task in tasks:
        for observed, copied in _copies(chain.scripted_solver(task, rng, mistake_rate=0.0,
                                                              slip_rate=0.1)):
            total += 1
            kept += copied == observed
            wrong_elsewhere += copied != observed and len(copied) != len(observed)
    assert wrong_elsewhere == 0  # slips change a digit, never drop one
    assert 0.8 < kept / total < 0.97
    clean = [chain.scripted_solver(t, rng, mistake_rate=0.0) for t in tasks]
    assert all(chain.verify(t, chain.final_answer(s))[0] == 1.0 for t, s in zip(tasks, clean))


def test_render_masks_prompt_and_observations():
    task = _task(37, "*7%97+5", 2)
    segments = chain.render(task, chain.scripted_solver(task, random.Random(0)))
    assert segments[0] == (task.prompt, False)
    for text, trained in segments[1:]:
        assert trained == (not text.startswith("<obs>"))


def test_corpus_for_tokenizer_has_no_tags():
    corpus = chain.corpus_for_tokenizer(count=20)
    assert any(text.startswith("step ") for text in corpus)
    assert any(text.startswith("calc ") for text in corpus)
    assert "error" in corpus
    assert not any("<" in text or ">" in text for text in corpus)


def test_chain_environment_scores_the_answer():
    import asyncio

    env = chain.ChainEnvironment()
    task = _task(37, "*7%97+5", 1)  # 70
    assert env.type == "chain" and env.task_model is ChainTask
    result = asyncio.run(env.grade(None, task, "70"))  # the sandbox is not consulted
    assert (result.reward, result.parts["correct"]) == (1.0, 1.0)
    assert asyncio.run(env.grade(None, task, "7")).reward == 0.0
    assert asyncio.run(env.apply_solution(None, task, b"70\n")) == "70"


def test_chain_demonstration_is_the_scripted_solver_with_its_outputs():
    env = chain.ChainEnvironment()
    task = _task(37, "*7%97+5", 2)  # 70, then 10 (70 ends in 0: the blind spot may fire)
    turns = env.demonstrate(task, random.Random(0))
    solver = chain.scripted_solver(task, random.Random(0), mistake_rate=0.75)
    assert [t.tool_calls[0].arguments["value"] for t in turns[:-1]] == [
        a.text.removeprefix("<call>step ").removesuffix("</call>") for a in solver[0:-1:2]]
    assert [t.outputs for t in turns[:-1]] == [[o.text[5:-6]] for o in solver[1::2]]
    assert turns[-1].tool_calls == [] and turns[-1].content == chain.final_answer(solver)


def test_zipf_repeats_follows_the_documented_law():
    sampler = chain.ZipfRepeats(num_steps=2, tail=1.0)
    assert sampler.high == 8
    harmonic = sum(1 / j for j in range(1, 9))
    assert sampler.probabilities == pytest.approx([1 / k / harmonic for k in range(1, 9)])
    rng = random.Random(0)
    n = 20000
    draws = [sampler(rng) for _ in range(n)]
    assert set(draws) == set(range(1, 9))
    for k, p in enumerate(sampler.probabilities, 1):
        # Within 4 standard errors of the binomial count.
        assert abs(draws.count(k) / n - p) < 4 * (p * (1 - p) / n) ** 0.5, k
    assert [sampler(random.Random(7)) for _ in range(3)] == [sampler(random.Random(7))] * 3
    uniform = chain.ZipfRepeats(num_steps=1, tail=0.0)
    assert uniform.probabilities == pytest.approx([0.25] * 4)
    steep = chain.ZipfRepeats(num_steps=2, tail=3.0)
    assert steep.probabilities[0] > 0.8 > sampler.probabilities[0]


def test_zipf_repeats_rejects_counts_a_task_cannot_hold():
    assert chain.MAX_REPEATS == 9
    with pytest.raises(ValueError, match=r"num_steps: .*12 calls"):
        chain.ZipfRepeats(num_steps=3, tail=1.0)
    with pytest.raises(ValueError, match="length_tail"):
        chain.ZipfRepeats(num_steps=2, tail=-1.0)
    with pytest.raises(ValueError, match="sample_repeats"):
        chain.generate_tasks(1, seed=0, sample_repeats=lambda rng: 10)


def test_generate_tasks_with_long_tailed_lengths():
    sampler = chain.ZipfRepeats(num_steps=2, tail=1.0)
    tasks = chain.generate_tasks(3000, seed=4, num_steps=2, sample_repeats=sampler)
    again = chain.generate_tasks(3000, seed=4, num_steps=2, sample_repeats=sampler)
    assert [t.model_dump() for t in tasks] == [t.model_dump() for t in again]
    counts = [t.repeats for t in tasks]
    assert min(counts) == 1 and max(counts) == 8
    # The split and de-duplication filters ignore the count, so kept tasks follow the law too.
    assert counts.count(1) / len(counts) == pytest.approx(sampler.probabilities[0], abs=0.04)
    assert sum(counts) / len(counts) == pytest.approx(
        sum(k * p for k, p in enumerate(sampler.probabilities, 1)), abs=0.2)
    for t in tasks[:50]:
        assert t.prompt == chain.render_prompt(t.start, t.step, t.repeats)
        assert t.answer == chain.chain_values(t.start, t.step, t.repeats)[-1]
    held = chain.generate_tasks(500, seed=4, split="heldout", num_steps=2, sample_repeats=sampler)
    assert not {(t.start, t.step, t.repeats) for t in tasks} & {(t.start, t.step, t.repeats) for t in held}
    # The default (no sampler) stream is untouched: every task takes num_steps calls.
    assert {t.repeats for t in chain.generate_tasks(50, seed=4, num_steps=2)} == {2}


def test_load_task_set_wires_the_spec_fields(tmp_path):
    from kiln.api.spec import TaskSetSpec
    from kiln.services.sandbox.episodes import EpisodeError, load_task_set

    fixed = TaskSetSpec.model_validate({"name": "a", "env": "chain", "generate": {"count": 20, "seed": 1}})
    assert [t.model_dump() for t in load_task_set(fixed, tmp_path).tasks] == [
        t.model_dump() for t in chain.generate_tasks(20, 1)]
    tailed = TaskSetSpec.model_validate({"name": "b", "env": "chain", "generate": {
        "count": 400, "seed": 1, "numSteps": 2, "lengthTail": 1.0}})
    counts = [t.repeats for t in load_task_set(tailed, tmp_path).tasks]
    assert max(counts) == 8 and counts.count(1) > counts.count(2) > counts.count(8) > 0
    too_long = TaskSetSpec.model_validate({"name": "c", "env": "chain", "generate": {
        "count": 5, "numSteps": 4, "lengthTail": 1.0}})
    with pytest.raises(EpisodeError, match=r"spec.tasks\[c\].generate: num_steps"):
        load_task_set(too_long, tmp_path)
    with pytest.raises(ValueError, match="lengthTail"):
        TaskSetSpec.model_validate({"name": "d", "env": "chain", "generate": {"count": 5, "lengthTail": -1}})


def test_step_is_the_calculator_on_the_tasks_step():
    task = _task(37, "*7%97+5", 2)
    assert chain.tool_call(task, Step("37")) == Call("37*7%97+5")
    assert chain.tool_call(task, Call("1+1")) == Call("1+1")
    assert chain.run_tool_locally(chain.tool_call(task, Step("70"))) == "<obs>10</obs>"
    assert chain.tool_command(chain.tool_call(task, Step("-3"))) == ["expr", "-3", "*", "7", "%", "97", "+", "5"]
