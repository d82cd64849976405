"""How one serving instance behaves: each stage's time at a batch size, its KV capacity, and the
batch caps that keep both phases within their SLOs (vLLM's `--max-num-seqs` and
`--max-num-batched-tokens`). One construction shared by the simulator, the capacity check and the
Pulumi program's engine settings, so they can never disagree.

A stage's time comes from the same function the library uses (`PerfModel.stage_time_ms`: its
layers at its TP on its node, plus its hop to the next stage; the last stage sends none, and a
disaggregated prefill's KV transfer is timed by the simulator). A data-parallel stage (general
mode) splits each micro-batch across its members in proportion to their speed; its KV capacity
is the sum of its members'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.performance.perf_model import PerfModel
from solver.serving.engine_model import (
    SEARCH_STEPS,
    PrefillEngine,
    aggregated_capacity,
    prefill_capacity,
)
from solver.serving.serving_template import ServingTemplate
from solver.stack import ModelSpec
from solver.types import Phase

CHUNK_TPOT_FACTOR = 2.0  # an aggregated step may take up to this many TPOT SLOs (see bench_vidur)
MIN_CHUNK_TOKENS = 256
PASS_MEMO_MAX = 1 << 20  # prefill pass times shared per PerfModel (cleared when full)
# --max-num-batched-tokens is the candidate that serves the most at the SLO (`engine_model` at
# the mean lengths): for prefill-only, these and the largest batch within the TTFT SLO (a big
# chunk packs every waiting prompt into one slow step, so under load each waits for all the
# others); for aggregated, these and the largest chunk within CHUNK_TPOT_FACTOR TPOT SLOs (a
# smaller chunk stalls decodes less but prefills a prompt in more rounds).
PREFILL_CHUNKS = (512, 1024, 2048, 4096)
AGGREGATED_CHUNKS = (256, 512, 1024, 2048)  # below the CHUNK_TPOT_FACTOR bound


@dataclass(frozen=True)
class Member:
    node: str  # node config whose speed and network apply (x1 for one-GPU processes)
    tp: int


@dataclass(frozen=True)
class Stage:
    members: tuple[Member, ...]  # more than one: data parallel, each with a share of the batch
    layers: int
    hop: bool  # sends its activations to a next stage (every stage but the last)


class InstanceModel:
    """Timing and KV capacity of one serving instance (cached per batch size)."""

    def __init__(
        self,
        perf: PerfModel,
        template: ServingTemplate,
        spec_ctx: float,
        prompt: float,
        slo_ms: tuple[float, float] | None = None,
        output: float = 1.0,
        target: float = 0.9,
    ) -> None:
        self.perf, self.model = perf, template.model
        self._factors: dict[tuple[str, str], float] = {}  # (node, phase) -> step_factor
        self.throughput = template.throughput
        card = perf.card(template.model)
        s_count = len(template.stages)
        self.stages: list[Stage] = []
        for i, st in enumerate(template.stages):
            members = []
            for m in st.members:
                cfg = perf.catalog.node(template.nodes[m.node])
                node = cfg.id if len(m.gpus) == cfg.gpu_count else f"{cfg.gpu_id}x{len(m.gpus)}"
                members.append(Member(node, m.tp))
            self.stages.append(Stage(tuple(members), st.layers, hop=i < s_count - 1))
        self.ctx, self.prompt, self.output = spec_ctx, prompt, output
        # A data-parallel stage's share per member: proportional to the member's speed at a
        # typical batch (decode: 32 sequences; prefill: one mean prompt).
        self._shares = {
            (i, phase): self._member_shares(i, phase)
            for i in range(len(self.stages))
            for phase in ("prefill", "decode")
        }
        # Each stage as `_prefill_pass_ms` shares it: a number per distinct (model, members,
        # layers, hop, shares) in the PerfModel (None: on a measured table, not shared).
        ids = perf.prefill_stage_ids
        self._signatures = [
            None
            if any(
                perf.measured.get(self.model, perf.catalog.node(m.node).id, "prefill") is not None
                for m in st.members
            )
            else ids.setdefault(
                (self.model, st.members, st.layers, st.hop, self._shares[(i, "prefill")]), len(ids)
            )
            for i, st in enumerate(self.stages)
        ]
        self.kv_capacity = min(
            sum(
                perf.kv_capacity_tokens(card, perf.catalog.node(m.node), m.tp, s.layers)
                for m in s.members
            )
            for s in self.stages
        )
        self.network_gbps = min(
            perf.catalog.node(m.node).network_gbps for s in self.stages for m in s.members
        )
        self.kv_bytes_per_token = card.kv_bytes_per_token_per_layer * card.layers
        self._decode: dict[int, float] = {}
        self._batch_fixed: dict[tuple[int, int, str, int], float] = {}
        self._attention: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        self._prefill: dict[int, tuple[float, float]] = {}
        self._alone: dict[tuple[int, int], float] = {}
        # The runtime caps batches at what meets the SLO (vLLM's --max-num-seqs and
        # --max-num-batched-tokens), as the template library assumed when it sized them.
        self.max_running = 1 << 30
        self.max_prefill_tokens = 1 << 30
        self.max_batched_tokens = 1 << 30
        if slo_ms is not None:
            pre_slo, dec_slo = slo_ms
            # --max-num-seqs: the largest decode batch within the TPOT SLO, and no more
            # sequences than the KV cache holds at the mean context (more would only be
            # preempted and recomputed).
            # A prefill-only instance decodes nothing: only the KV cache bounds its sequences.
            kv_seqs = int(self.kv_capacity // max(1.0, spec_ctx))
            if template.phase == "prefill":
                self.max_running = max(1, kv_seqs)
            else:
                self.max_running = max(
                    1, min(_largest(lambda b: self.decode_round_ms(b) <= dec_slo, 1 << 16), kv_seqs)
                )
            self.max_prefill_tokens = max(
                64,
                _largest(
                    lambda x: self.prefill_ms(x)[0] <= pre_slo, perf.settings.max_batch_tokens
                ),
            )
            # --max-num-batched-tokens, the chunk of every step: the candidate that serves most
            # at the SLO (`_best_chunk`), at most the largest prefill batch within the TTFT SLO;
            # an aggregated step shares its chunk with decodes, so its chunk is also at most the
            # largest whose step (all stages) stays within CHUNK_TPOT_FACTOR x the TPOT SLO.
            chunk = self.max_prefill_tokens
            if template.phase == "aggregated":
                chunk = min(
                    chunk,
                    _largest(lambda x: self.prefill_ms(x)[0] <= CHUNK_TPOT_FACTOR * dec_slo, chunk),
                )
            chunk = max(chunk, self.max_running, MIN_CHUNK_TOKENS)
            if template.phase != "decode":
                chunk = self._best_chunk(template.phase, chunk, slo_ms, target)
            self.max_batched_tokens = chunk

    def _best_chunk(self, phase: str, top: int, slo_ms: tuple[float, float], target: float) -> int:
        """The chunk, of the phase's candidates up to `top`, that serves the most at the SLO
        (`engine_model`, at the mean prompt and output; the smallest on a tie)."""
        prompt = np.array([max(1.0, self.prompt)])
        sizes = PREFILL_CHUNKS if phase == "prefill" else AGGREGATED_CHUNKS
        # vLLM needs --max-num-batched-tokens >= --max-num-seqs (every decode takes a token).
        candidates = sorted({c for c in sizes if self.max_running <= c < top} | {top})
        if phase == "prefill":
            engine = PrefillEngine.of(self, candidates, prompt)
            served = prefill_capacity(engine, prompt, 1.0, slo_ms[0], target, SEARCH_STEPS)
            return candidates[int(np.argmax(served))]  # the first (smallest) on a tie
        output = np.array([max(1.0, self.output)])
        return max(
            candidates,
            key=lambda c: aggregated_capacity(
                self,
                prompt,
                output,
                1.0,
                slo_ms,
                target,
                c,
                self.max_running,
                self.throughput,
                SEARCH_STEPS,
            ),
        )

    def _member_shares(self, i: int, phase: Phase) -> tuple[float, ...]:
        stage = self.stages[i]
        if len(stage.members) == 1:
            return (1.0,)
        ref = 32 if phase == "decode" else max(1, round(self.prompt))
        speed = [1.0 / self._member_ms(m, stage, phase, ref) for m in stage.members]
        return tuple(v / sum(speed) for v in speed)

    def _member_ms(self, m: Member, stage: Stage, phase: Phase, size: int) -> float:
        context = self.ctx if phase == "decode" else self.prompt
        return self.perf.stage_time_ms(
            self.model, m.node, m.tp, phase, size, context, stage.layers, stage.hop
        )

    def stage_ms(self, i: int, phase: Phase, size: int) -> float:
        """Stage i's time for a micro-batch of `size` (sequences or tokens): its slowest share."""
        stage = self.stages[i]
        return max(
            self._member_ms(m, stage, phase, math.ceil(size * share))
            for m, share in zip(stage.members, self._shares[(i, phase)], strict=True)
        )

    @classmethod
    def serving(cls, perf: PerfModel, template: ServingTemplate, spec: ModelSpec) -> InstanceModel:
        """The instance as it serves its model: the workload's mean context and prompt, and
        batches capped at the SLO-feasible sizes (what the Pulumi program passes to vLLM)."""
        slo = (spec.slo_ms.prefill, spec.slo_ms.decode)
        return cls(
            perf,
            template,
            spec.decode_context_tokens,
            spec.mean_prompt_tokens,
            slo,
            spec.mean_output_tokens,
            spec.slo_attainment,
        )

    def batch_stage_ms(
        self, tokens: int, decode_seqs: int, decode_context: float, prefill_pairs: float
    ) -> list[float]:
        """Each stage's time for one mixed micro-batch (vLLM's chunked prefill): `tokens` tokens
        in all, `decode_seqs` of them decodes at a mean context of `decode_context`, and
        prefill chunks with `prefill_pairs` = sum of chunk x (cached + chunk). A data-parallel
        stage splits the batch by its members' shares and takes its slowest.

        The simulator calls this once per engine step: the token-proportional part of each
        stage (layers, per-step cost, hop) is memoised per token count, attention is two
        multiply-adds."""
        phase: Phase = "prefill" if prefill_pairs > 0 else "decode"
        held = self.perf.card(self.model).kv_tokens_held(decode_context) if decode_seqs else 0.0
        return [
            self._stage_step_ms(i, phase, tokens, decode_seqs, decode_context, held, prefill_pairs)
            for i in range(len(self.stages))
        ]

    def _stage_step_ms(
        self,
        i: int,
        phase: Phase,
        tokens: int,
        decode_seqs: int,
        decode_context: float,
        held: float,
        prefill_pairs: float,
    ) -> float:
        """Stage i's time in `batch_stage_ms`: its slowest member's share of the batch."""
        stage = self.stages[i]
        worst = 0.0
        for k, (m, share) in enumerate(
            zip(stage.members, self._shares[(i, "prefill")], strict=True)
        ):
            t = max(1, math.ceil(tokens * share))
            key = (i, k, phase, t)
            fixed = self._batch_fixed.get(key)
            if fixed is None:
                fixed = self.perf.stage_fixed_ms(
                    self.model, m.node, m.tp, phase, t, stage.layers, stage.hop
                )
                if fixed is None:  # measured table: whole layers, attention included
                    linear = self.perf.batch_layer_ms(
                        self.model, m.node, m.tp, t, decode_seqs, decode_context, prefill_pairs
                    )
                    self._attention[(i, k)] = (0.0, 0.0, 0.0, 0.0)
                    fixed = self.perf.stage_of_layers_ms(
                        self.model, m.node, phase, t, stage.layers, stage.hop, linear
                    )
                self._batch_fixed[key] = fixed
            terms = self._attention.get((i, k))
            if terms is None:
                terms = self._attention[(i, k)] = self.perf.attention_terms(
                    self.model, m.node, m.tp
                )
            dec_lat, dec_ms, pre_lat, pre_ms = terms
            attention = 0.0
            if decode_seqs:
                attention += dec_lat + math.ceil(decode_seqs * share) * held * dec_ms
            if prefill_pairs:
                attention += pre_lat + prefill_pairs * share * pre_ms
            worst = max(worst, (fixed + stage.layers * attention) * self._factor(m.node, phase))
        return worst

    def _factor(self, node: str, phase: Phase) -> float:
        """The fleet's measured correction of this step on `node` (`PerfModel.step_factor`)."""
        key = (node, phase)
        factor = self._factors.get(key)
        if factor is None:
            factor = self._factors[key] = self.perf.step_factor(self.model, node, phase)
        return factor

    def _prefill_pass_ms(self, i: int, tokens: int, pairs: float) -> float:
        """Stage i's time for one prefill pass of `tokens` tokens with `pairs` attention pairs
        and no decodes (`_stage_step_ms`), shared through the PerfModel with every instance
        whose stage i is the same (members, layers, hop, shares): the capacity model asks it of
        thousands of templates built from the same stages. Stages on a measured table are not
        shared (their memo depends on the instance's history)."""
        phase: Phase = "prefill" if pairs > 0 else "decode"  # as batch_stage_ms says
        signature = self._signatures[i]
        if signature is None:
            return self._stage_step_ms(i, phase, tokens, 0, 0.0, 0.0, pairs)
        key = (signature, tokens, pairs)
        memo = self.perf.prefill_pass_memo
        hit = memo.get(key)
        if hit is None:
            if len(memo) >= PASS_MEMO_MAX:
                memo.clear()
            hit = memo[key] = self._stage_step_ms(i, phase, tokens, 0, 0.0, 0.0, pairs)
        return hit

    def decode_round_ms(self, running: int) -> float:
        if running not in self._decode:
            micro = math.ceil(running / len(self.stages))
            worst = max(self.stage_ms(i, "decode", micro) for i in range(len(self.stages)))
            self._decode[running] = len(self.stages) * worst
        return self._decode[running]

    def prompt_alone_ms(self, length: int, chunk: int) -> float:
        """A prompt of `length` tokens prefilled alone at chunk `chunk`: ceil(length / chunk)
        equal passes through every stage, pass i's piece attending to the i pieces before it
        and itself. Attention is linear in the pairs, so the passes sum to rounds passes at the
        mean pairs, piece x piece x (rounds + 1) / 2."""
        rounds = max(1, -(-length // chunk))
        piece = length / rounds
        key = (length, chunk)
        if key not in self._alone:
            pairs = piece * piece * (rounds + 1) / 2
            tokens = math.ceil(piece)
            self._alone[key] = rounds * sum(
                [self._prefill_pass_ms(i, tokens, pairs) for i in range(len(self.stages))]
            )
        return self._alone[key]

    def prefill_ms(self, tokens: int) -> tuple[float, float]:
        """(latency, period): sum and max of the stage times for a micro-batch of `tokens`."""
        key = -(-tokens // 64) * 64  # cache at 64-token granularity (rounded up)
        if key not in self._prefill:
            times = [self.stage_ms(i, "prefill", key) for i in range(len(self.stages))]
            self._prefill[key] = (sum(times), max(times))
        return self._prefill[key]


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """Largest x in [1, hi] with ok(x), assuming ok is monotone (0 if ok(1) fails)."""
    if not ok(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
