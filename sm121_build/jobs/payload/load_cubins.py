"""Load cubins with the CUDA driver and find their kernels by name (`sm121-build prove`).

Standard library only (ctypes on libcuda.so.1): run as a script by any python3, with no
import of this package.  `prove` runs it with CUDA_DISABLE_PTX_JIT=1 and CUDA_CACHE_DISABLE=1,
so a cubin that loads is one the GPU runs as it is.

    python3 load_cubins.py probe        the GPU (device 0), one JSON line; exit 3 without one
    python3 load_cubins.py load LIST    the GPU's line, then a line per cubin of LIST

LIST is JSON: [{"id": "...", "path": "CUBIN", "kernels": ["name", ...]}, ...].  Each line
on stdout is one JSON object:

    {"device": {"name": "...", "major": 9, "minor": 0, "driver": 13000, "version": "...",
                "smem_block": B, "smem_sm": S, "sms": N}}     (shared memory, SM count)
    {"error": "..."}                                  no GPU: nothing else follows (exit 3)
    {"cubin": ID, "loaded": true, "found": N, "missing": [...], "missing_count": M}
    {"cubin": ID, "loaded": false, "error": "CUDA_ERROR_..."}
    {"done": N}                                       every cubin of LIST answered
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

NO_GPU = 3
MISSING_SHOWN = 20  # names per cubin; the count is always whole
_MAJOR, _MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
# what a harness's dispatch reads of the GPU: CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_
# BLOCK_OPTIN, _MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, _MULTIPROCESSOR_COUNT
_SIZES = {"smem_block": 97, "smem_sm": 81, "sms": 16}


def _say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


class Driver:
    """The few driver calls the proof needs, each checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUresult {code}"

    def call(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise OSError(f"{name}: {self.error_name(code)}")


def device(driver: Driver) -> tuple[dict[str, Any], ctypes.c_int]:
    """Device 0 (CUDA_VISIBLE_DEVICES chooses it), described, its primary context current."""
    driver.call("cuInit", 0)
    count = ctypes.c_int()
    driver.call("cuDeviceGetCount", ctypes.byref(count))
    if count.value < 1:
        raise OSError("the driver lists no CUDA device")
    handle = ctypes.c_int()
    driver.call("cuDeviceGet", ctypes.byref(handle), 0)
    name = ctypes.create_string_buffer(256)
    driver.call("cuDeviceGetName", name, 256, handle)
    major, minor, version = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    driver.call("cuDeviceGetAttribute", ctypes.byref(major), _MAJOR, handle)
    driver.call("cuDeviceGetAttribute", ctypes.byref(minor), _MINOR, handle)
    driver.call("cuDriverGetVersion", ctypes.byref(version))
    sizes = {}
    for key, attribute in _SIZES.items():
        value = ctypes.c_int()
        driver.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, handle)
        sizes[key] = value.value
    context = ctypes.c_void_p()
    driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), handle)
    driver.call("cuCtxSetCurrent", context)
    return {"name": name.value.decode("utf-8", "replace"), "major": major.value,
            "minor": minor.value, "driver": version.value,
            "version": _kernel_module_version(), **sizes}, handle


def _kernel_module_version() -> str | None:
    """The kernel module's version (`580.95.05`), as /proc names it; None where it is not."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    words = text.split()
    for at, word in enumerate(words[:-1]):
        if word == "Kernel" and words[at + 1] == "Module":
            rest = [w for w in words[at + 2:at + 6] if w[:1].isdigit()]
            return rest[0] if rest else None
    return None


def load(driver: Driver, item: dict[str, Any]) -> dict[str, Any]:
    """One cubin: loaded with cuModuleLoadData, each kernel looked up, unloaded."""
    image = Path(item["path"]).read_bytes()
    module = ctypes.c_void_p()
    code = driver.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image))
    if code != 0:
        return {"cubin": item["id"], "loaded": False, "error": driver.error_name(code)}
    missing = []
    function = ctypes.c_void_p()
    for kernel in item["kernels"]:
        if driver.lib.cuModuleGetFunction(ctypes.byref(function), module,
                                          kernel.encode()) != 0:
            missing.append(kernel)
    driver.lib.cuModuleUnload(module)
    return {"cubin": item["id"], "loaded": True, "found": len(item["kernels"]) - len(missing),
            "missing": missing[:MISSING_SHOWN], "missing_count": len(missing)}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("probe", "load") or (argv[0] == "load") != (len(argv) == 2):
        sys.stderr.write("usage: load_cubins.py probe | load LIST\n")
        return 2
    try:
        driver = Driver()
        described, _handle = device(driver)
    except (OSError, AttributeError) as exc:
        _say({"error": str(exc)[:300] or type(exc).__name__})
        return NO_GPU
    _say({"device": described})
    if argv[0] == "probe":
        return 0
    items = json.loads(Path(argv[1]).read_text())
    for item in items:
        _say(load(driver, item))
    _say({"done": len(items)})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DISABLE_PTX_JIT", "1")  # (set by prove; a hand run too)
    sys.exit(main(sys.argv[1:]))
