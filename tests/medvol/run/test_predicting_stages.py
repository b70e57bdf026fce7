"""predict.py's stages run one after the other, each taking what the one before gave: after the request is made, no
stage is handed the command's config, and no stage calls back into the spine."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import medvol.run.predicting as predicting

RUN = Path(predicting.__file__).parent


def _calls_after_the_request(tree: ast.AST) -> list[ast.Call]:
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "predict")
    calls = sorted((n for n in ast.walk(function) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    names = [c.func.id if isinstance(c.func, ast.Name) else "" for c in calls]
    return calls[names.index("predict_request") + 1:]


def test_no_stage_after_the_request_is_handed_the_commands_config():
    later = _calls_after_the_request(ast.parse(inspect.getsource(predicting)))
    handed = [ast.unparse(c) for c in later
              if any(isinstance(n, ast.Name) and n.id == "cfg" for a in [*c.args, *c.keywords] for n in ast.walk(a))]
    assert later and not handed, handed


def test_the_spine_is_one_function_that_nothing_else_calls_back():
    defined = [n.name for n in ast.parse(inspect.getsource(predicting)).body if isinstance(n, ast.FunctionDef)]
    assert defined == ["predict"]
    importers = [p.name for p in RUN.glob("*.py") if "medvol.run.predicting" in p.read_text()]
    assert importers == [], importers


def test_the_stage_check_reads_a_config_handed_on_after_the_request(tmp_path):
    # The check above, held against a spine that hands the config on: it must go red.
    source = inspect.getsource(predicting).replace(
        "return predict_job(request, model, run, runs.checkpoints, plan.sw_batch_size)",
        "return predict_job(request, model, run, runs.checkpoints, plan.sw_batch_size, cfg)",
    )
    later = _calls_after_the_request(ast.parse(source))
    assert any("cfg" in ast.unparse(c) for c in later)
