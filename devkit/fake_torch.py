"""FAKE: what the stand-in `torch` modules of the harnesses' tests share (tests/unit's
FA2_TORCH and MARLIN_TORCH, run as `torch` by harness_fa2.py and harness_marlin.py): device
0 reports an H100's compute capability, SM count and shared memory; a generator that draws
nothing.  No GPU, no kernel."""

H100_CUDA = """
class _Props:
    major, minor, multi_processor_count = 9, 0, 132
    shared_memory_per_block_optin, shared_memory_per_multiprocessor = 232448, 233472
class cuda:
    @staticmethod
    def synchronize(): pass
    @staticmethod
    def get_device_properties(n): return _Props()
class Generator:
    def __init__(self, device): pass
    def manual_seed(self, seed): return self
"""
