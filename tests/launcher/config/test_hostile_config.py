"""Hostile config input (issue 28.5, docs/reliability.md): alias bombs, a recursive alias, nesting too deep, a file
that is not a mapping or not UTF-8, wrong types. Each is one line naming the cause and the fix, exit 2, nothing
written, and no alias bomb is ever expanded."""
from __future__ import annotations

import time

import pytest

from launcher import cli
from launcher.config import schema

BASE = """\
run: {output_dir: runs/demo, seed: 0, epochs: 1}
task: {target: builtin:regression, args: ARGS}
data: {micro_batch_size: 16}
accumulation: {schedule: {0: 1}}
optimizer: {name: sgd, lr: 0.01}
distributed: {backend: ddp, nproc_per_node: 1}
"""


def bomb(levels: int = 9, width: int = 9) -> str:
    """A flow mapping of ``levels`` anchors, each ``width`` aliases of the one before: width**levels strings."""
    parts = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "{" + ", ".join(parts) + "}"


CASES = [
    ("top-level-list", b"- run\n- task\n", [], "error: config: ", "holds a list, not a mapping"),
    ("top-level-scalar", b"42\n", [], "error: config: ", "holds a int, not a mapping"),
    ("not-utf8", BASE.replace("runs/demo", "runs/\xff").encode("latin-1"), [], "error: config: ", "not UTF-8"),
    ("alias-bomb-file", BASE.replace("ARGS", bomb()).encode(), [], "error: config: ", "alias bomb"),
    ("alias-bomb-set", BASE.replace("ARGS", "{}").encode(), ["task.args=" + bomb()], "error: --set task.args: ",
     "alias bomb"),
    ("recursive-alias", BASE.replace("ARGS", "&me {again: *me}").encode(), [], "error: config: ", "endless"),
    ("recursive-alias-set", BASE.replace("ARGS", "{}").encode(), ["task.args=&me [*me]"], "error: --set task.args: ",
     "endless"),
    ("nested-too-deep", BASE.replace("ARGS", "{x: " + "[" * 3000 + "]" * 3000 + "}").encode(), [],
     "error: config: ", "nested too deeply"),
    ("section-scalar", BASE.replace("ARGS", "{}").replace("data: {micro_batch_size: 16}", "data: 16").encode(), [],
     "error: data: ", "expected a mapping"),
    ("epochs-list", BASE.replace("ARGS", "{}").replace("epochs: 1", "epochs: [1, 2]").encode(), [],
     "error: run.epochs: ", "expected an integer"),
    ("lr-string", BASE.replace("ARGS", "{}").encode(), ["optimizer.lr=fast"], "error: optimizer.lr: ",
     "expected a number"),
]


@pytest.mark.parametrize("name,text,sets,start,cause", CASES, ids=[c[0] for c in CASES])
def test_hostile_config_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch, name, text, sets,
                                                                start, cause):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cfg.yaml"
    path.write_bytes(text)
    for command in ("check", "run"):
        began = time.monotonic()
        assert cli.main([command, str(path)] + [a for s in sets for a in ("--set", s)]) == 2
        assert time.monotonic() - began < 10  # refused, not expanded
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start) and cause in err[0] and "; " in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]  # nothing launched, nothing written


def test_aliases_within_the_bound_still_work():
    ok = schema.safe_load("a: &a {x: 1, y: [1, 2]}\nb: *a\nc: {<<: *a, z: 3}\n")
    assert ok == {"a": {"x": 1, "y": [1, 2]}, "b": {"x": 1, "y": [1, 2]}, "c": {"x": 1, "y": [1, 2], "z": 3}}
    assert schema.safe_load(bomb(levels=4, width=9)) is not None  # 9**4 values: under the bound
    with pytest.raises(schema.ConfigError, match="alias bomb"):
        schema.safe_load(bomb(levels=6, width=9))  # 9**6 = 531441 > MAX_YAML_VALUES
