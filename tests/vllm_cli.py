"""Check rendered `vllm serve` command lines against the pinned vLLM's own argument list.

The argument list is a fixture extracted from vLLM 0.33.0's parser by
`scripts/extract_vllm_args.py` (no vLLM import here). On top of flag names, value arity and
simple types, it checks the cross-rank rules vLLM itself enforces at start-up
(vLLM 0.33.0's parallel config and `vllm serve` entrypoint; see its multi-node docs):

- world size TP x PP divisible by --nnodes, which holds when every node runs the same ranks;
- --node-rank within 0..nnodes-1; --headless on every rank but 0;
- identical engine arguments on all ranks except rank, headless, host and port;
- VLLM_PP_LAYER_PARTITION with PP positive entries summing to the model's layer count.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "vllm-0.33.0-serve-args.json"
PER_RANK = {"--node-rank", "--headless", "--host", "--port"}


@cache
def options() -> dict[str, dict]:
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    out = {}
    for opt in data["options"]:
        for flag in opt["flags"] + opt["hidden_flags"]:
            out[flag] = opt
    return out


def parse(argv: list[str]) -> dict[str, list[str]]:
    """flag -> values; raises AssertionError like argparse's exit 2 would."""
    assert argv and not argv[0].startswith("-"), f"first argument must be the model: {argv[:1]}"
    known = options()
    parsed: dict[str, list[str]] = {}
    i = 1
    while i < len(argv):
        flag = argv[i]
        assert flag in known, f"unknown vLLM 0.33.0 flag {flag}"
        opt = known[flag]
        values: list[str] = []
        if opt["takes_value"]:
            n = 1 if opt["nargs"] in (None, "?") else None
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--") and (n is None or len(values) < n):
                values.append(argv[j])
                j += 1
            assert values, f"{flag} needs a value"
            kind = opt["wrapped_type"] or opt["type"]
            for v in values:
                if kind == "int":
                    int(v)
                elif kind == "float":
                    float(v)
                elif kind == "parse_dataclass":
                    json.loads(v)
                if opt["choices"]:
                    assert v in opt["choices"], f"{flag} {v}: not in {opt['choices']}"
            i = j
        else:
            i += 1
        assert flag not in parsed, f"{flag} given twice"
        parsed[flag] = values
    return parsed


def check_replica(argvs: list[list[str]], partition: str, layers: int) -> None:
    """Every rank's argv parses, and the ranks agree as vLLM's mp multi-node launcher needs."""
    parsed = [parse(a) for a in argvs]
    first = parsed[0]
    tp = int(first.get("--tensor-parallel-size", ["1"])[0])
    pp = int(first.get("--pipeline-parallel-size", ["1"])[0])
    nnodes = int(first.get("--nnodes", ["1"])[0])
    assert (tp * pp) % nnodes == 0, f"--nnodes {nnodes} must divide world size {tp * pp}"
    assert len(argvs) == nnodes, f"{len(argvs)} processes for --nnodes {nnodes}"
    ranks = sorted(int(p.get("--node-rank", ["0"])[0]) for p in parsed)
    assert ranks == list(range(nnodes)), f"node ranks {ranks}"
    for a, p in zip(argvs, parsed, strict=True):
        rank = int(p.get("--node-rank", ["0"])[0])
        assert ("--headless" in p) == (rank > 0), f"rank {rank}: --headless must be on ranks > 0"
        assert a[0] == argvs[0][0], "every rank must load the same model path"
        shared = {k: v for k, v in p.items() if k not in PER_RANK}
        assert shared == {k: v for k, v in first.items() if k not in PER_RANK}, "engine args differ"
    parts = [int(x) for x in partition.split(",")]
    assert len(parts) == pp, f"VLLM_PP_LAYER_PARTITION has {len(parts)} entries for PP={pp}"
    assert all(x > 0 for x in parts) and sum(parts) == layers, f"{partition} vs {layers} layers"
