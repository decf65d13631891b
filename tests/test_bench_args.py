"""`cpullm bench` refuses what it could only fail at the end, before it loads a model: --plot
without matplotlib, and a --plot path that cannot be written."""
import argparse
import sys

import pytest

import cpullm
import cpullm.store
from cpullm import errors
from cpullm.cli import main
from cpullm.cli.commands import bench as bench_command


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load, the default model's download included, fails the test."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(cpullm, "load", loaded)
    monkeypatch.setattr(cpullm.store, "ensure_default_model", loaded)


def _bench_error(capsys, *argv) -> str:
    assert main(["bench", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpullm: error: ") and err.count("\n") == 1, err
    return err


def test_plot_without_matplotlib_fails_before_loading(monkeypatch, tmp_path, capsys, no_model_load):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # `import matplotlib` raises
    err = _bench_error(capsys, "--plot", tmp_path / "profile.png")
    assert "--plot needs matplotlib" in err and "pip install 'cpullm[plot]'" in err
    with pytest.raises(errors.MissingDependencyError):
        bench_command.check_args(argparse.Namespace(plot=str(tmp_path / "profile.png")))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["missing folder", "a directory", "a file as folder"])
def test_unwritable_plot_path_fails_before_loading(case, tmp_path, capsys, no_model_load):
    pytest.importorskip("matplotlib", reason="with no matplotlib, --plot fails on that first")
    (tmp_path / "notes.txt").write_text("the user's file\n")
    (tmp_path / "charts").mkdir()
    path, fix = {"missing folder": (tmp_path / "nowhere" / "p.png", "mkdir -p"),
                 "a directory": (tmp_path / "charts", "give a file name"),
                 "a file as folder": (tmp_path / "notes.txt" / "p.png", "is a file, not a folder")}[case]
    err = _bench_error(capsys, "--plot", path)
    assert fix in err and str(path) in err
    with pytest.raises(errors.OutputPathError):
        bench_command.check_writable_file(path, "--plot")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["charts", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "the user's file\n"
    assert list((tmp_path / "charts").iterdir()) == []


def test_writable_plot_path_passes_and_leaves_nothing(tmp_path):
    bench_command.check_writable_file(tmp_path / "profile.png", "--plot")
    (tmp_path / "old.png").write_bytes(b"old")
    bench_command.check_writable_file(tmp_path / "old.png", "--plot")     # replacing is allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]
    assert (tmp_path / "old.png").read_bytes() == b"old"
