"""``make test-compat``: the package as users meet it in the runtimes they cannot change.

For each pin file named on the command line (compat/<name>.txt), in parallel:

1. a venv of the Python the file names (``# python: 3.13``), made by uv from pyenv's
   interpreters (never a downloaded one), holding exactly those pins;
2. ``pip install <wheel>`` as a user types it, dry run: it must not want to replace any
   package already there; then ``pip install <wheel> --constraint <pins>`` for real, with
   ``pip freeze`` before and after: any package already there that changed or went away
   fails the environment, and the diff is printed;
3. the test tools, installed under the same constraints (nothing pinned moves), and the
   kernel-facing tests of compat/tests.txt, run from a copy of tests/ outside the checkout,
   so that the ranks and kernels import the installed wheel.

An environment built from the same pin file, wheel, tools and interpreter is reused.
Each environment's output is kept in .compat/<name>/log.txt and printed under its name.
Standard library only: it runs under any Python 3.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "compat"
# The test tools: not in the runtimes, installed after the install check, under the pins.
# pytest below 9 for the reason pyproject.toml gives; safetensors for the big-model tests
# where a runtime lacks it (the oldest floors); py-spy for the stacks of a test's kernels and
# ranks when it runs past its safety net.
TOOLS = [
    "pytest>=8,<9",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "psutil>=5.9",
    "nbclient>=0.10",
    "nbformat>=5.9",
    "safetensors",
    "py-spy",
]
# Bumped when what an environment holds changes in a way the inputs above do not show.
RECIPE = "1"


def python_version_of(pins: Path) -> str:
    found = re.search(r"^# python: (3\.\d+)\s*$", pins.read_text(), re.MULTILINE)
    if not found:
        raise SystemExit(f"{pins}: no '# python: 3.X' line says which Python it is for")
    return found.group(1)


def interpreter(version: str) -> str:
    """pyenv's Python ``version``: the ``python3.X`` on PATH where it runs (a pyenv shim runs
    only for the versions pyenv's global setting names), else pyenv's own folder."""
    candidates = [shutil.which(f"python{version}")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", "python3"))
    candidates += sorted(found, key=lambda p: [int(x) for x in re.findall(r"\d+", p)], reverse=True)
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(
        f"no Python {version}: neither python{version} on PATH nor {root}/versions/{version}.*"
    )


class Env:
    def __init__(self, name: str, wheel: Path, uv: str) -> None:
        self.name = name
        self.pins = COMPAT / f"{name}.txt"
        self.wheel = wheel
        self.uv = uv
        self.dir = ROOT / ".compat" / name
        self.venv = self.dir / "venv"
        self.python = str(self.venv / "bin" / "python")
        self.log_path = self.dir / "log.txt"
        self.lines: list[str] = []
        self.times: dict[str, float] = {}

    # -- output -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.lines.append(text.rstrip("\n"))

    def run(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(args, capture_output=True, text=True, **kwargs)
        if check and done.returncode != 0:
            self.say(f"$ {' '.join(args)}\n{done.stdout}{done.stderr}")
            raise Failed(f"{args[0]} {' '.join(args[1:3])} ... exited {done.returncode}")
        return done

    # -- the environment ----------------------------------------------------------------------
    def key(self, python: str) -> str:
        digest = hashlib.sha256()
        digest.update(RECIPE.encode())
        digest.update(self.pins.read_bytes())
        digest.update(self.wheel.read_bytes())
        digest.update("\n".join(TOOLS).encode())
        digest.update(self.run(python, "-c", "import sys; print(sys.version)").stdout.encode())
        return digest.hexdigest()

    def build(self) -> None:
        version = python_version_of(self.pins)
        python = interpreter(version)
        key = self.key(python)
        stamp = self.dir / "built-from"
        report = self.dir / "install-check.txt"
        if stamp.exists() and stamp.read_text() == key and report.exists():
            self.say(f"reused .compat/{self.name}/venv (same pins, wheel, tools and Python)")
            self.say(report.read_text())
            return
        started = time.monotonic()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        # --seed: the runtimes' users install with pip, so pip checks the install.
        self.run(self.uv, "venv", "-q", "--seed", "--python", python, str(self.venv), env=env)
        self.run(
            self.uv, "pip", "install", "-q", "--python", self.python, "-r", str(self.pins), env=env
        )
        self.times["runtime"] = time.monotonic() - started
        lines = [f"Python {version} ({python}); pins {self.pins.relative_to(ROOT)}"]
        before = self.freeze()

        started = time.monotonic()
        pip = [self.python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        # What a user types, with no constraints: it must want to replace nothing.
        dry = self.run(*pip, "install", "--dry-run", str(self.wheel))
        wanted = re.findall(r"^Would install (.*)$", dry.stdout, re.MULTILINE)
        wanted_names = [_name(w.rsplit("-", 1)[0]) for w in " ".join(wanted).split()]
        replaced = sorted(n for n in wanted_names if n in before)
        lines.append(
            f"pip install {self.wheel.name} (dry run) would install: {' '.join(wanted) or 'nothing'}"
        )
        if replaced:
            lines.append(f"a plain pip install would REPLACE: {', '.join(replaced)}")
        try:
            self.run(*pip, "install", "-q", str(self.wheel), "--constraint", str(self.pins))
        except Failed:
            self.say("\n".join(lines))
            raise
        after = self.freeze()
        self.times["wheel"] = time.monotonic() - started
        lines.append(
            f"pip install {self.wheel.name} --constraint {self.pins.relative_to(ROOT)}: succeeded"
        )
        changed = [
            f"-{name}=={before[name]}\n+{name}=={after[name]}"
            if name in after
            else f"-{name}=={before[name]} (removed)"
            for name in sorted(before)
            if after.get(name) != before[name]
        ]
        added = sorted(
            f"+{name}" + ("" if "://" in after[name] else f"=={after[name]}")
            for name in after
            if name not in before
        )
        lines.append(
            f"pip freeze before/after: {len(before)} packages before, "
            f"{len(changed)} changed or removed, {len(added)} added ({', '.join(added)})"
        )
        if changed:
            lines.append("CHANGED by installing the package:\n" + "\n".join(changed))
        self.say("\n".join(lines))
        (self.dir / "freeze-before.txt").write_text(_freeze_text(before))
        (self.dir / "freeze-after.txt").write_text(_freeze_text(after))
        if changed or replaced:
            raise Failed("installing the package changed the runtime")

        started = time.monotonic()
        self.run(
            self.uv, "pip", "install", "-q", "--python", self.python,
            "--constraint", str(self.pins), *TOOLS, env=env,
        )  # fmt: skip
        self.times["tools"] = time.monotonic() - started
        report.write_text("\n".join(lines))
        stamp.write_text(key)

    def freeze(self) -> dict[str, str]:
        out = self.run(self.python, "-m", "pip", "--disable-pip-version-check", "freeze").stdout
        versions: dict[str, str] = {}
        for line in out.splitlines():
            if "==" in line:
                name, version = line.split("==", 1)
            elif " @ " in line:
                name, version = line.split(" @ ", 1)
            else:
                continue
            versions[_name(name)] = version.strip()
        return versions

    # -- the tests ----------------------------------------------------------------------------
    def test(self, selection: list[str], extra: list[str]) -> None:
        """The tests run from a copy outside the package's folder: what they, their kernels
        and their ranks import is the installed wheel."""
        workdir = self.dir / "run"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "browser")
        shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
        shutil.copytree(ROOT / "examples", workdir / "examples", ignore=ignore)
        shutil.copy(ROOT / "pyproject.toml", workdir / "pyproject.toml")
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
        }
        env.update(PYTHONPATH=str(workdir), PATH=f"{self.venv / 'bin'}:{os.environ['PATH']}")
        started = time.monotonic()
        output = self.dir / "pytest.txt"  # written as the tests run: tail -f to follow
        with output.open("w") as sink:
            returncode = subprocess.run(
                [self.python, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--timeout=240",
                 "--durations=10", *extra, *selection],
                stdout=sink, stderr=subprocess.STDOUT, cwd=workdir, env=env,
            ).returncode  # fmt: skip
        self.times["tests"] = time.monotonic() - started
        where = output.read_text()
        self.say(where)
        imported = self.run(
            self.python, "-c", "import notebook_launcher; print(notebook_launcher.__file__)",
            cwd=workdir, env=env,
        ).stdout.strip()  # fmt: skip
        self.say(f"the tests imported notebook_launcher from {imported}")
        if not imported.startswith(str(self.venv)):
            raise Failed(f"the tests did not import the installed wheel but {imported}")
        if returncode != 0:
            summary = where.strip().splitlines()[-1] if where.strip() else ""
            raise Failed(f"the tests failed (pytest exit {returncode}): {summary}")


class Failed(Exception):
    pass


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _freeze_text(versions: dict[str, str]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(versions.items()))


def read_selection() -> list[str]:
    """compat/tests.txt's words, each test file named by its name alone found under tests/
    (so the list survives tests moving between folders)."""
    text = (COMPAT / "tests.txt").read_text()
    words = [word for line in text.splitlines() for word in line.split("#", 1)[0].split()]
    return [word if word.startswith("-") else _test_path(word) for word in words]


def _test_path(node: str) -> str:
    name, _, rest = node.partition("::")
    found = sorted((ROOT / "tests").rglob(name))
    if len(found) != 1:
        raise SystemExit(f"compat/tests.txt: {name} matches {len(found)} files under tests/")
    path = found[0].relative_to(ROOT).as_posix()
    return f"{path}::{rest}" if rest else path


def one(env: Env, selection: list[str], extra: list[str], build_only: bool) -> bool:
    try:
        env.build()
        if not build_only:
            env.test(selection, extra)
        ok = True
    except Failed as failure:
        env.say(f"FAILED: {failure}")
        ok = False
    except Exception as error:  # a broken tool: say which environment, keep the others
        env.say(f"FAILED: {type(error).__name__}: {error}")
        ok = False
    times = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in env.times.items())
    env.say(f"{env.name}: {'passed' if ok else 'FAILED'} ({times or 'nothing timed'})")
    env.dir.mkdir(parents=True, exist_ok=True)
    env.log_path.write_text("\n".join(env.lines) + "\n")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="+", help="pin files of compat/, without .txt")
    parser.add_argument("--wheel", required=True, type=Path)
    parser.add_argument("--uv", required=True)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--jobs", type=int, default=0, help="environments at once (0: all)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # for pytest
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    selection = read_selection()
    envs = [Env(name, args.wheel.resolve(), args.uv) for name in args.names]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.jobs or len(envs)) as pool:
        results = list(pool.map(lambda e: one(e, selection, extra, args.build_only), envs))
    for env in envs:
        print(f"\n==================== {env.name} ====================", flush=True)
        print("\n".join(env.lines), flush=True)
    print(
        f"\n==================== test-compat: {time.monotonic() - started:.0f} s ===================="
    )
    for env, ok in zip(envs, results):
        times = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in env.times.items())
        print(f"{env.name:8} {'passed' if ok else 'FAILED'}  {times}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
