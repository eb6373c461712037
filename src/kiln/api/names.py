"""What an RLJob's name must be for its children to be valid Kubernetes objects.

Every child is named `<job>-<component>` (`kiln.operator.naming`). Services are among them, and
a Service's name is a DNS-1035 label: a lowercase letter first, at most 63 characters. The
longest child is the data-parallel trainer's StatefulSet, `<job>-trainer-replica`, and
Kubernetes labels its pods `controller-revision-hash: <statefulset>-<10-character hash>`, a label
value of at most 63 characters; so the name is at most 63 - 11 - 16 = 36 characters.
`tests/unit/test_job_names.py` builds every child of a job with the longest name and checks
them. Torch-free.
"""
from __future__ import annotations

import re

LONGEST_CHILD = "trainer-replica"
"""The longest component suffix (`kiln.operator.workloads.TRAINER_REPLICAS`)."""
REVISION_HASH = len("-") + 10
"""What Kubernetes appends to a StatefulSet's name in its pods' controller-revision-hash."""
MAX_JOB_NAME = 63 - REVISION_HASH - len("-" + LONGEST_CHILD)


def job_name_problem(name: str) -> str | None:
    """Why `name` cannot name an RLJob's children, or None."""
    if not re.match(r"^[a-z]", name):
        return (f"{name!r} must start with a lowercase letter: the job's Services are named "
                f"{name}-<component> (e.g. {name}-trainer), and a Service's name is a DNS-1035 "
                "label")
    if len(name) > MAX_JOB_NAME:
        return (f"{name!r} has {len(name)} characters, at most {MAX_JOB_NAME} fit: the "
                f"StatefulSet {name}-{LONGEST_CHILD} plus the 11-character revision hash "
                "Kubernetes appends in its pods' labels must stay within 63")
    return None
