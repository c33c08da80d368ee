"""One cached Python 3.12 venv with jax/jaxlib 0.11.2 for the compile-only GPU checks.

`ensure_venv()` builds (or reuses) ``~/.cache/jaxmoe/compile-venv-<versions>`` (or under
``$JAXMOE_CACHE_DIR``): jax and jaxlib 0.11.2, the CUDA 13 PJRT plugin installed with
``--no-deps`` (compile only: no CUDA runtime wheels, XLA calls the system ``ptxas``), and
what importing ``jaxmoe`` / ``pallas_kernels`` and running tests/test_pallas_lowering.py
need. The repository is not installed there: the checks put it on ``PYTHONPATH``.

`ensure_intel()` adds the Intel pieces for benchmarks/intel_compile_check.py under
``~/.cache/jaxmoe/intel-<versions>``: the oneAPI PJRT plugin (``pip --no-deps --target``),
the ``.so`` files of the 13 Intel runtime wheels it links (their ``*.data/data/lib``,
which ``pip --target`` drops, unzipped into one lib dir), Debian's Level Zero loader
(``apt-get download libze1``, unpacked there, unless the system has it) and a 3-function
shim for the entry points that loader lacks, built with gcc (docs/intel.md).

Every version is pinned here, in `PINS`; a ``.complete`` marker is written only after a
complete install, so a half-built directory is rebuilt. Run it directly to build both:
``python benchmarks/compile_venv.py [--intel] [-q]`` prints the venv's python (last line).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

#: The one place where versions live.
PINS = {
    "jax": "0.11.2",
    "jaxlib": "0.11.2",
    # CUDA 13 PJRT plugin, --no-deps: compile only (no nvidia-* runtime wheels)
    "jax-cuda13-plugin": "0.11.2",
    "jax-cuda13-pjrt": "0.11.2",
    # importing jaxmoe / pallas_kernels (pyproject's dependencies) and the lowering test
    "flax": "0.12.12",
    "numpy": "2.4.6",
    "pyyaml": "6.0.3",
    "gguf": "0.19.0",
    "safetensors": "0.8.0",
    "rich": "15.0.0",
    "matplotlib": "3.11.2",
    "optax": "0.2.8",
    "pytest": "9.0.3",
    "hypothesis": "6.155.2",
}
NO_DEPS = ("jax-cuda13-plugin", "jax-cuda13-pjrt")

#: Intel: the plugin (0.11.2 is its only release, built against jax 0.11.2) and the runtime
#: wheels pinned by ``jax-oneapi-plugin[with-oneapi]==0.11.2``.
INTEL_PLUGIN = {"jax-oneapi-pjrt": "0.11.2", "jax-oneapi-plugin": "0.11.2"}
INTEL_RUNTIME = {
    "impi-rt": "2021.15.0",
    "intel-cmplr-lib-rt": "2025.1.1",
    "intel-cmplr-lib-ur": "2025.1.1",
    "intel-opencl-rt": "2025.1.1",
    "intel-sycl-rt": "2025.1.1",
    "mkl": "2025.1.0",
    "onemkl-sycl-blas": "2025.1.0",
    "onemkl-sycl-dft": "2025.1.0",
    "onemkl-sycl-lapack": "2025.1.0",
    "onemkl-sycl-rng": "2025.1.0",
    "onemkl-sycl-sparse": "2025.1.0",
    "tcmlib": "1.3.0",
    "umf": "0.10.0",
}
#: Entry points the plugin's Level Zero adapter imports that Debian bookworm's libze1 (1.8)
#: lacks; never called at compile time.
ZE_SHIM_C = """\
typedef int ze_result_t;
#define ZE_RESULT_ERROR_UNSUPPORTED_FEATURE 0x78000003
ze_result_t zeDeviceGetRootDevice(void *d, void **r) { (void)d; (void)r; return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; }
ze_result_t zeCommandListHostSynchronize(void *l, unsigned long long t) { (void)l; (void)t; return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; }
ze_result_t zeImageViewCreateExt(void *c, void *d, const void *desc, void *i, void **v) {
  (void)c; (void)d; (void)desc; (void)i; (void)v; return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; }
"""

REPO = Path(__file__).resolve().parent.parent
MARKER = ".complete"


class SetupError(RuntimeError):
    """A missing prerequisite (python3.12, gcc, libze) or a failed install, with what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("JAXMOE_CACHE_DIR") or Path.home() / ".cache" / "jaxmoe")


def _tag(pins: dict[str, str]) -> str:
    h = hashlib.sha256(repr(sorted(pins.items())).encode()).hexdigest()[:10]
    return f"jax{pins.get('jax', '')}-{h}"


def venv_dir() -> Path:
    return cache_root() / f"compile-venv-py312-{_tag(PINS)}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def find_python312() -> str:
    """``$JAXMOE_PYTHON312``, ``python3.12`` on PATH, or pyenv's 3.12; else a SetupError."""
    cands = [os.environ.get("JAXMOE_PYTHON312"), shutil.which("python3.12")]
    cands += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / "3.12*" / "bin" / "python3.12")))
    for c in cands:
        # a pyenv shim exists even where 3.12 is not selected: ask the candidate itself
        if c and Path(c).exists():
            r = subprocess.run(
                [c, "-c", "import sys; print(sys.version_info >= (3, 12))"], capture_output=True, text=True
            )
            if r.returncode == 0 and r.stdout.strip() == "True":
                return c
    raise SetupError(
        "python3.12 not found (jax 0.11.2 needs Python >= 3.12): put python3.12 on PATH, "
        "install it with pyenv (pyenv install 3.12), or set JAXMOE_PYTHON312=/path/to/python3.12"
    )


def _run(cmd: list[str], what: str, **kw) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        raise SetupError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}")


def _pip(py: Path | str, *args: str) -> list[str]:
    return [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]


def ensure_venv(quiet: bool = False) -> Path:
    """The venv's python, building the venv first unless a complete one is cached."""
    d = venv_dir()
    if (d / MARKER).exists() and venv_python().exists():
        return venv_python()
    if d.exists():
        print(f"compile venv {d} is incomplete: rebuilding", file=sys.stderr)
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    py = find_python312()
    _run([py, "-m", "venv", str(d)], "creating the Python 3.12 venv")
    q = ["-q"] if quiet else []
    deps = [f"{n}=={v}" for n, v in PINS.items() if n not in NO_DEPS]
    _run(_pip(venv_python(), *q, *deps), "installing jax 0.11.2 and jaxmoe's dependencies")
    _run(
        _pip(venv_python(), *q, "--no-deps", *(f"{n}=={PINS[n]}" for n in NO_DEPS)),
        "installing the CUDA 13 plugin (--no-deps)",
    )
    (d / MARKER).write_text(repr(PINS) + "\n")
    return venv_python()


def reexec_in_venv(script: str, env: dict[str, str] | None = None) -> None:
    """Re-run ``script`` with the venv's python (the repo first on PYTHONPATH, plus ``env``:
    variables the dynamic loader reads at start-up must be set before the process starts),
    unless this process already is that."""
    py = ensure_venv()
    want = dict(env or {})
    want["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [want.get("PYTHONPATH")])])
    in_venv = Path(sys.prefix).resolve() == venv_dir().resolve()
    if in_venv and all(os.environ.get(k, "").startswith(v) for k, v in want.items()):
        return
    new = dict(os.environ)
    for k, v in want.items():
        sep = {"XLA_FLAGS": " "}.get(k, os.pathsep if k.endswith("PATH") else None)
        new[k] = sep.join([v, *filter(None, [os.environ.get(k)])]) if sep else v
    new["PYTHONNOUSERSITE"] = "1"
    sys.stdout.flush()
    os.execve(str(py), [str(py), script, *sys.argv[1:]], new)


# ---------------------------------------------------------------------------- Intel pieces


def intel_dir() -> Path:
    return cache_root() / f"intel-{_tag({**INTEL_PLUGIN, **INTEL_RUNTIME})}"


def find_libze() -> str | None:
    """The system Level Zero loader (Debian ``libze1``), or None."""
    for p in (
        "/usr/lib/x86_64-linux-gnu/libze_loader.so.1",
        "/usr/lib64/libze_loader.so.1",
        "/usr/lib/libze_loader.so.1",
    ):
        if Path(p).exists():
            return p
    return None


def ensure_intel(quiet: bool = False) -> dict[str, Path]:
    """``site`` (plugin target dir), ``lib`` (runtime .so files), ``shim`` (libze shim)."""
    d = intel_dir()
    out = {"site": d / "site", "lib": d / "lib", "shim": d / "libze_shim.so"}
    if (d / MARKER).exists():
        return out
    py = ensure_venv(quiet)
    if d.exists():
        print(f"Intel pieces {d} are incomplete: rebuilding", file=sys.stderr)
        shutil.rmtree(d)
    d.mkdir(parents=True)
    q = ["-q"] if quiet else []
    _run(
        _pip(py, *q, "--no-deps", "--target", str(out["site"]), *(f"{n}=={v}" for n, v in INTEL_PLUGIN.items())),
        "installing the oneAPI PJRT plugin (--no-deps --target)",
    )
    wheels = d / "wheels"
    _run(
        [str(py), "-m", "pip", "download", *q, "--disable-pip-version-check", "--no-deps", "--only-binary=:all:"]
        + ["--dest", str(wheels), *(f"{n}=={v}" for n, v in INTEL_RUNTIME.items())],
        "downloading the Intel runtime wheels",
    )
    out["lib"].mkdir()
    n = 0
    for w in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            for name in z.namelist():
                parts = name.split("/")
                if (
                    len(parts) >= 4
                    and parts[0].endswith(".data")
                    and parts[1:3] == ["data", "lib"]
                    and ".so" in parts[-1]
                ):
                    (out["lib"] / parts[-1]).write_bytes(z.read(name))
                    n += 1
    if n == 0:
        raise SetupError(f"no .so files found in the Intel runtime wheels under {wheels}")
    shutil.rmtree(wheels)  # the unzipped libraries are what is kept
    if find_libze() is None:  # Debian's Level Zero loader, unpacked (no system install)
        debs = d / "debs"
        debs.mkdir()
        apt = shutil.which("apt-get")
        if apt is None or subprocess.run([apt, "download", "libze1"], cwd=debs).returncode != 0:
            raise SetupError(
                "the Level Zero loader (libze_loader.so.1) is missing and `apt-get download libze1` failed: "
                "run `apt-get update` (or `apt-get install libze1`) first"
            )
        for deb in debs.glob("*.deb"):
            _run(["dpkg-deb", "-x", str(deb), str(debs / "x")], "unpacking libze1")
        for so in (debs / "x").rglob("libze_*.so*"):
            shutil.copy(so, out["lib"] / so.name, follow_symlinks=True)
        shutil.rmtree(debs)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise SetupError("gcc not found: it builds the 3-function Level Zero shim (apt-get install gcc)")
    src = d / "libze_shim.c"
    src.write_text(ZE_SHIM_C)
    _run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out["shim"]), str(src)], "building the Level Zero shim")
    (d / MARKER).write_text(repr({**INTEL_PLUGIN, **INTEL_RUNTIME}) + "\n")
    return out


def main() -> int:
    quiet = "-q" in sys.argv[1:]
    try:
        print(ensure_venv(quiet))
        if "--intel" in sys.argv[1:]:
            for k, v in ensure_intel(quiet).items():
                print(k, v)
    except SetupError as e:
        print(f"compile_venv: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
