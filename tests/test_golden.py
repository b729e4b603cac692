"""The generated code of one small model, kept in ``tests/golden/``: gpt-tiny on a 2x2 mesh under
the hand plan "fsdp(dp) x tp+sp(tp)" (ZeRO-3 gathers, tensor and sequence parallel moves), so that
any change to the emitted code shows as a diff in review. The plan is kept beside it: which
strategies a hand plan leaves to the solver may change with the cost model, and this test is
about the code generator. Regenerate both after an intended change:
``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py``, then read the diff."""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from autopar import MeshSpec, Plan
from autopar.core.capture import capture
from autopar.planning.baselines import candidates
from codegen.generate import generate
from tests.equivalence import build, make_batches

UPDATE_ENV = "AUTOPAR_UPDATE_GOLDEN"
GOLDEN = Path(__file__).parent / "golden"
NAME, MESH, HAND = "gpt-tiny", MeshSpec((2, 2)), "fsdp(dp) x tp+sp(tp)"
PLAN_FILE, CODE_FILE = GOLDEN / "gpt-tiny-2x2.plan.json", GOLDEN / "gpt-tiny-2x2.py.txt"
HOW = f"If the change is intended, regenerate: {UPDATE_ENV}=1 python -m pytest -q tests/test_golden.py"


def test_generated_code_is_the_golden_one():
    args, kwargs = make_batches(NAME, 8, 16, steps=1)[0]
    model = build(NAME)
    captured = capture(model, args, kwargs)
    update = os.environ.get(UPDATE_ENV) == "1"
    if update:
        PLAN_FILE.write_text(candidates(model, MESH, args, kwargs, names=[HAND])[HAND].to_json() + "\n")
    plan = Plan.from_json(PLAN_FILE.read_text())
    if plan.fingerprint != captured.fingerprint:
        pytest.fail(f"{PLAN_FILE.name} was made for another capture of {NAME} (the capture changed). {HOW}")
    source = generate(captured, plan).source
    if update:
        CODE_FILE.write_text(source)
    want = CODE_FILE.read_text()
    if source != want:
        diff = "".join(difflib.unified_diff(want.splitlines(keepends=True), source.splitlines(keepends=True),
                                            f"{CODE_FILE.relative_to(GOLDEN.parent.parent)}", "generated now"))
        pytest.fail(f"the generated code differs from the golden file:\n{diff}\n{HOW}, and review the diff",
                    pytrace=False)
