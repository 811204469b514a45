"""CI compile check of the CUDA sources and the torch binding (no GPU needed).

Every ``cuda/*.cu`` is compiled with ``nvcc -c`` for sm_80 and sm_90 with the defines torch's JIT build adds,
so a syntax or type error fails CI. The binding ``training/model/csrc/*.cpp`` is syntax-checked with g++
against the installed (CPU) torch headers; it includes only ``torch/extension.h``, so this is the same code
the GPU build compiles. Skipped (with the reason) only when ``nvcc`` / ``g++`` is absent.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from training.model.kernels import CSRC_DIR, CU_SOURCES, CUDA_ARCH_FLAGS, CUDA_DIR

NVCC = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))
GXX = shutil.which("g++")
# as torch.utils.cpp_extension.COMMON_NVCC_FLAGS: the .cu files must build under them
TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)


def test_every_cu_file_is_listed_for_the_build():
    on_disk = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(CU_SOURCES), "training.model.kernels.CU_SOURCES must list every cuda/*.cu"


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed: cannot compile the CUDA sources")
@pytest.mark.parametrize("source", CU_SOURCES)
def test_cu_compiles_for_sm80_and_sm90(source, tmp_path: Path):
    cmd = [
        NVCC,
        "-std=c++20",
        "-O3",
        "-Werror",
        "all-warnings",
        *TORCH_NVCC_DEFINES,
        *CUDA_ARCH_FLAGS,
        "-Xcompiler",
        "-fPIC",
        f"-I{CUDA_DIR}",
        "-c",
        str(CUDA_DIR / source),
        "-o",
        str(tmp_path / "k.o"),
    ]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"nvcc failed for {source}:\n{r.stderr}"
    assert (tmp_path / "k.o").stat().st_size > 0
    # the object holds machine code for both targets
    if shutil.which("cuobjdump") or Path(NVCC).with_name("cuobjdump").exists():
        cuobjdump = shutil.which("cuobjdump") or str(Path(NVCC).with_name("cuobjdump"))
        listing = subprocess.run(
            [cuobjdump, "--list-elf", str(tmp_path / "k.o")], check=False, capture_output=True, text=True
        )
        assert "sm_80" in listing.stdout and "sm_90" in listing.stdout, listing.stdout


@pytest.mark.slow  # ~1 min: torch/extension.h is a large header tree
@pytest.mark.skipif(GXX is None, reason="g++ not installed: cannot syntax-check the torch binding")
def test_binding_compiles_against_torch_headers():
    from torch.utils.cpp_extension import include_paths

    incs = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    for cpp in sorted(CSRC_DIR.glob("*.cpp")):
        cmd = [
            GXX,
            "-std=c++20",
            "-fsyntax-only",
            "-Wall",
            "-DTORCH_EXTENSION_NAME=sleuth_kernels",
            *incs,
            str(cpp),
        ]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"g++ failed for {cpp.name}:\n{r.stderr[-4000:]}"
