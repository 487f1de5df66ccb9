"""Compare two saved output files (fa2_outputs.py, marlin_outputs.py) element by element:
`python3 fa2_compare.py A.pt B.pt`."""
import json
import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
same = 0
for key in a:
    equal = torch.equal(a[key], b[key])
    same += equal
    print(json.dumps({"config": key, "bitwise_equal": equal,
                      "max_abs_diff": (a[key].float() - b[key].float()).abs().max().item()}))
print(f"{same} of {len(a)} configs bitwise equal")
sys.exit(0 if same == len(a) else 1)
