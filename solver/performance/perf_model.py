"""The performance model behind every plan: layer times and the profile table T̂_j(c).

`PerfModel` combines the analytical model (`solver/performance/analytical.py`) with fitted
efficiencies, measured operator times where a profile covers the layer's shape on the GPU
(`operator_tables.py`: they replace the fitted GEMM and elementwise terms) and any measured
whole-layer tables (which win for their (model, node config, phase)).
`profile_table` computes, for a (model, phase, per-stage latency budget), the most tokens/s each
node config delivers holding j layers while the stage meets the budget and the KV cache fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from solver.catalog.model_cards import ModelCard, ModelId, get_card
from solver.catalog.offers import Catalog, NodeConfig
from solver.errors import InputError, unknown_value
from solver.performance.analytical import (
    AllReduceFit,
    Efficiency,
    KernelFactors,
    LayerBreakdown,
    LayerTime,
    NodeCosts,
    PerfSettings,
    Runtime,
    hop_ms,
    layer_breakdown,
    valid_tp_degrees,
)
from solver.performance.measured_tables import MeasuredTables
from solver.performance.operator_tables import OperatorTables
from solver.types import Phase

GB = 1e9
LAYER_MEMO_MAX = 1 << 17  # memoised layer times kept per PerfModel (cleared when full)


DEFAULT_RUNTIME = "vllm"


@dataclass(frozen=True)
class Calibration:
    """Resolved calibration: efficiency per GPU type (its own fit or a documented derivation,
    `origin` says which), the runtimes' fixed costs and all-reduce fits per interconnect."""

    gpus: dict[str, Efficiency]
    origin: dict[str, str]
    kernels: dict[str, KernelFactors]
    runtimes: dict[str, Runtime]
    allreduce: dict[str, dict[int, AllReduceFit]]
    provenance: str = ""
    # Measured GEMM and elementwise times that win over the fit where they cover the layer
    operators: OperatorTables = field(default_factory=OperatorTables)

    def for_gpu(self, gpu_id: str) -> Efficiency:
        """The GPU's factors.

        Raises:
            InputError: the GPU has neither its own factors nor a derivation.
        """
        eff = self.gpus.get(gpu_id)
        if eff is None:
            raise InputError(
                f"gpus.{gpu_id}",
                f"GPU '{gpu_id}' has no efficiency factors and no derivation",
                "add its factors under gpus: or a derivation under derived: in "
                "solver/data/calibration.yaml",
            )
        return eff

    def kernels_for(self, gpu_id: str) -> KernelFactors:
        """The GPU's attention and elementwise kernel factors.

        Raises:
            InputError: the GPU has none (resolved from solver/data/calibration.yaml).
        """
        k = self.kernels.get(gpu_id)
        if k is None:
            raise InputError(
                f"kernels.{gpu_id}",
                f"GPU '{gpu_id}' has no attention/elementwise kernel factors",
                "add it under kernels.derived: in solver/data/calibration.yaml",
            )
        return k

    def runtime(self, name: str) -> Runtime:
        """A runtime by name.

        Raises:
            InputError: no such runtime in the data file.
        """
        if name not in self.runtimes:
            raise unknown_value("runtime", name, self.runtimes, "runtime")
        return self.runtimes[name]

    def costs(self, cfg: NodeConfig, runtime: str) -> NodeCosts:
        """Everything the layer model needs for `cfg` under `runtime`."""
        link = cfg.gpu.interconnect
        return NodeCosts(
            eff=self.for_gpu(cfg.gpu_id),
            overheads=self.runtime(runtime).overheads(runtime, cfg.gpu_id),
            kernels=self.kernels_for(cfg.gpu_id),
            interconnect=link,
            allreduce=self.allreduce.get(link, {}) if link else {},
        )


@dataclass(frozen=True)
class ProfileEntry:
    """T̂_j(c): one node config holding j layers."""

    node: str
    layers: int
    tokens_per_s: float
    batch: int
    stage_ms: float
    tp: int
    kv_capacity_tokens: int
    source: str


@dataclass(frozen=True)
class PerfModel:
    """Layer times and profile tables for every (model, node config).

    Frozen: the memoised layer and step times below depend on every field, so a model with other
    settings, calibration, measured tables or runtime is a new one (`dataclasses.replace`).
    """

    catalog: Catalog
    cards: dict[ModelId, ModelCard]
    calibration: Calibration
    settings: PerfSettings = field(default_factory=PerfSettings)
    measured: MeasuredTables = field(default_factory=MeasuredTables)
    runtime: str = DEFAULT_RUNTIME
    # Step-time corrections measured on a running fleet (`coral calibrate`): (GPU type, model,
    # phase) -> factor; `step_factor` says which applies to a step.
    corrections: Mapping[tuple[str, str, str], float] = field(default_factory=dict)
    # ms per layer by (model, node, TP, phase, size, context): the profile table's binary
    # searches revisit the same sizes across layer counts, budgets and with or without a hop.
    _layer_memo: dict[tuple[str, str, int, str, float, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _step_memo: dict[tuple[str, str], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # A stage's token-proportional time by (model, node, TP, phase, tokens, layers, hop): the
    # same stages recur across the thousands of templates the capacity model and simulator see.
    _fixed_memo: dict[tuple[str, str, int, str, int, int, bool], float | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # One pipeline stage's prefill pass by (stage, tokens, attention pairs), for
    # `InstanceModel`: templates share stages (`InstanceModel._prefill_pass_ms`).
    prefill_pass_memo: dict[tuple[int, int, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    prefill_stage_ids: dict[tuple[object, ...], int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def card(self, model: ModelId) -> ModelCard:
        return get_card(self.cards, model)

    def layer_time(
        self, model: ModelId, node: str, phase: Phase, size: float, context: float
    ) -> LayerTime:
        """ms per layer for a decode batch / prefill token count `size` on `node`.

        Raises:
            InputError: a non-positive size or context, or a size past a measured table's range.
        """
        if size <= 0:
            field_name = "batch" if phase == "decode" else "tokens"
            raise InputError(field_name, f"must be > 0, got {size}", "pass a positive number")
        if context <= 0:
            raise InputError("context", f"must be > 0, got {context}", "pass a positive number")
        card = self.card(model)
        cfg = self.catalog.node(node)
        table = self.measured.get(model, cfg.id, phase)
        if table is not None:
            ms = table.ms_at(size)
            if ms is None:
                raise InputError(
                    "size",
                    f"{size} is past the measured table {table.source} (max {table.max_x})",
                    "measure larger sizes or stay within the table",
                )
            return LayerTime(ms, cfg.gpu_count, "measured")
        return min(
            (self._analytical(card, cfg, tp, phase, size, context) for tp in self._tps(card, cfg)),
            key=lambda lt: (lt.ms, lt.tp),
        )

    def step_factor(self, model: ModelId, node: str, phase: Phase) -> float:
        """The measured correction of a step of `phase` (prefill: it carries prompt tokens;
        decode: decodes alone) of `model` on `node`'s GPU type: the fleet's correction for that
        phase, else for the model served aggregated (one factor for all its steps), else 1."""
        if not self.corrections:
            return 1.0
        gpu = self.catalog.node(node).gpu_id
        factor = self.corrections.get((gpu, model, phase))
        return (
            factor if factor is not None else self.corrections.get((gpu, model, "aggregated"), 1.0)
        )

    def _tps(self, card: ModelCard, cfg: NodeConfig) -> list[int]:
        tps = valid_tp_degrees(card, cfg.gpu_count)
        if not tps:  # tp=1 always divides; kept as a guard for odd data
            raise InputError("node", f"no valid TP degree on {cfg.id}", "use another node")
        return tps

    def _analytical(
        self, card: ModelCard, cfg: NodeConfig, tp: int, phase: Phase, size: float, ctx: float
    ) -> LayerTime:
        ms = self._breakdown(card, cfg, tp, phase, size, ctx).ms
        return LayerTime(ms, tp, "analytical")

    def _breakdown(
        self, card: ModelCard, cfg: NodeConfig, tp: int, phase: Phase, size: float, ctx: float
    ) -> LayerBreakdown:
        costs = self.calibration.costs(cfg, self.runtime)
        fitted = layer_breakdown(card, cfg, costs, tp, phase, size, ctx)
        table = self.calibration.operators.get(cfg.gpu_id, card, tp)
        measured = table.at(size) if table is not None else None
        if measured is None:
            return fitted
        gemm_ms, elementwise_ms = measured
        return replace(fitted, gemm_ms=gemm_ms, elementwise_ms=elementwise_ms)

    def layer_breakdown(
        self, model: ModelId, node: str, phase: Phase, size: float, context: float
    ) -> tuple[LayerTime, LayerBreakdown | None]:
        """`layer_time` and, when the analytical model produced it, its components at that TP
        (None for a measured table, which has no components).

        Raises:
            InputError: as `layer_time`.
        """
        lt = self.layer_time(model, node, phase, size, context)
        if lt.source == "measured":
            return lt, None
        cfg = self.catalog.node(node)
        return lt, self._breakdown(self.card(model), cfg, lt.tp, phase, size, context)

    def step_overhead_ms(self, node: str, phase: Phase) -> float:
        """The runtime's fixed cost per pipeline-stage pass on `node` (once, not per layer)."""
        cfg = self.catalog.node(node)
        key = (cfg.gpu_id, phase)
        if key not in self._step_memo:
            runtime = self.calibration.runtime(self.runtime)
            self._step_memo[key] = runtime.overheads(self.runtime, cfg.gpu_id).step_ms(phase)
        return self._step_memo[key]

    def kv_capacity_tokens(self, card: ModelCard, cfg: NodeConfig, tp: int, layers: int) -> int:
        """KV tokens that fit beside `layers` layers on `tp` GPUs of the node (0 if none).

        Each stage is charged one vocab x hidden matrix: the first stage holds the input
        embedding, the last the LM head, and which stage a node serves is not known here. vLLM's
        memory fraction applies to the memory the device reports (MiB), not the datasheet's GB.
        """
        s = self.settings
        usable = tp * (cfg.gpu.memory_bytes * s.gpu_memory_utilization - s.runtime_reserve_gb * GB)
        free = usable - layers * card.layer_weight_bytes - card.embedding_bytes
        per_token = layers * card.kv_bytes_per_token_per_layer * tp / min(tp, card.kv_heads)
        return max(0, int(free // per_token))

    def max_layers(self, model: ModelId, node: str) -> int:
        """Most layers the node can hold with a useful KV cache (settings.min_kv_tokens)."""
        card, cfg = self.card(model), self.catalog.node(node)
        best = 0
        for tp in self._tps(card, cfg):
            for j in range(card.layers, 0, -1):
                if self.kv_capacity_tokens(card, cfg, tp, j) >= self.settings.min_kv_tokens:
                    best = max(best, j)
                    break
        return best

    def profile_table(
        self,
        model: ModelId,
        phase: Phase,
        budget_ms: float,
        nodes: list[str] | None = None,
        context: float = 1024,
        hop: bool = True,
        tp: int | None = None,
        in_flight: int = 1,
    ) -> list[ProfileEntry]:
        """T̂ for every node config (default: every node config the catalog sells).

        Args:
            context: decode context tokens, or prefill prompt length per request.
            hop: charge the stage for sending its activations to the next stage (False for a
                single stage and for the last stage of a pipeline, which sends nothing on).
            tp: use only this TP degree (vLLM's one-TP-size rule); default: the best valid one.
            in_flight: decode micro-batches a stage holds KV for at once: a pipeline of S
                stages keeps S in flight, so each may use only 1/S of the stage's KV cache.
        """
        if budget_ms <= 0:
            raise InputError("budget_ms", f"must be > 0, got {budget_ms}", "pass a positive budget")
        card = self.card(model)
        out = []
        for node in nodes if nodes is not None else list(self.catalog.node_configs):
            cfg = self.catalog.node(node)
            for j in range(1, card.layers + 1):
                entry = self._best_entry(
                    card, model, cfg, phase, j, budget_ms, context, hop, tp, in_flight
                )
                if entry is None:
                    break  # more layers only take longer and leave less memory
                out.append(entry)
        return out

    def _best_entry(
        self,
        card: ModelCard,
        model: ModelId,
        cfg: NodeConfig,
        phase: Phase,
        j: int,
        budget_ms: float,
        context: float,
        hop: bool,
        only_tp: int | None = None,
        in_flight: int = 1,
    ) -> ProfileEntry | None:
        tps = [t for t in self._tps(card, cfg) if only_tp in (None, t)]
        candidates = [
            e
            for tp in tps
            if (
                e := self._entry(card, model, cfg, tp, phase, j, budget_ms, context, hop, in_flight)
            )
        ]
        return max(candidates, key=lambda e: (e.tokens_per_s, -e.tp), default=None)

    def _entry(
        self,
        card: ModelCard,
        model: ModelId,
        cfg: NodeConfig,
        tp: int,
        phase: Phase,
        j: int,
        budget_ms: float,
        context: float,
        hop: bool,
        in_flight: int = 1,
    ) -> ProfileEntry | None:
        kv_cap = self.kv_capacity_tokens(card, cfg, tp, j)
        if kv_cap < self.settings.min_kv_tokens:
            return None
        held = card.kv_tokens_held(context)
        # Decode holds `context` tokens per sequence; prefill writes one KV entry per token.
        max_size = int(kv_cap // (held * in_flight)) if phase == "decode" else kv_cap
        max_size = min(max_size, self.settings.max_batch_tokens)
        measured = self.measured.get(model, cfg.id, phase)
        if measured is not None:
            if tp != cfg.gpu_count:
                return None  # a measured table describes the node as benchmarked
            max_size = min(max_size, int(measured.max_x))

        def stage_ms(size: int) -> float:
            return self.stage_time_ms(model, cfg.id, tp, phase, size, context, j, hop)

        size = _largest_within(stage_ms, budget_ms, max_size)
        if size == 0:
            return None
        ops = self.calibration.operators.get(cfg.gpu_id, card, tp) if measured is None else None
        if ops is not None:
            # Measured GEMMs run in steps: a batch at the end of a step can serve more tokens/s
            # than the largest batch within the budget. Between measured sizes time is linear,
            # so the best batch is a measured size or the largest one.
            steps = [int(x) for x in ops.tokens if x < size]
            size = max([size, *steps], key=lambda x: (x * 1e3 / stage_ms(x), x))
        t = stage_ms(size)
        return ProfileEntry(
            node=cfg.id,
            layers=j,
            tokens_per_s=size * 1e3 / t,
            batch=size,
            stage_ms=t,
            tp=tp,
            kv_capacity_tokens=kv_cap,
            source="measured" if measured is not None else "analytical",
        )

    def stage_time_ms(
        self,
        model: ModelId,
        node: str,
        tp: int,
        phase: Phase,
        size: float,
        context: float,
        layers: int,
        hop: bool,
    ) -> float:
        """One pipeline stage: `layers` layers at TP `tp` on `node`, the runtime's per-step cost
        (once per stage pass, measured tables included: they time layers, not steps), plus its
        outgoing hop.

        `size` is the decode batch or prefill token count; `context` the decode context or the
        prompt length; `hop` whether the stage sends its activations to a next stage (every
        stage of a pipeline but the last). The profile table and the simulator both time stages
        with this; a measured correction (`step_factor`) scales the whole stage.
        """
        card, cfg = self.card(model), self.catalog.node(node)
        layer = self._layer_ms(card, model, cfg, tp, phase, size, context)
        stage = self.stage_of_layers_ms(model, node, phase, size, layers, hop, layer)
        return stage * self.step_factor(model, node, phase)

    def stage_of_layers_ms(
        self,
        model: ModelId,
        node: str,
        phase: Phase,
        size: float,
        layers: int,
        hop: bool,
        layer_ms: float,
    ) -> float:
        """A stage of `layers` layers taking `layer_ms` each on `node`: the layers, the
        runtime's per-step cost and, with `hop`, the outgoing hop of `size` tokens."""
        hop_cost = self.hop_ms(model, node, size) if hop else 0.0
        return layers * layer_ms + self.step_overhead_ms(node, phase) + hop_cost

    def batch_layer_ms(
        self,
        model: ModelId,
        node: str,
        tp: int,
        tokens: int,
        decode_seqs: int,
        decode_context: float,
        prefill_pairs: float,
    ) -> float:
        """One layer of a mixed step (vLLM's chunked prefill: decodes and prefill chunks in one
        batch of `tokens` tokens), ms: the token-proportional kernels at `tokens`
        (`linear_layer_ms`), decode attention for `decode_seqs` sequences at a mean of
        `decode_context` tokens, and prefill attention over `prefill_pairs` = sum of
        chunk x (cached + chunk) over the prefill chunks (`attention_terms`).
        """
        phase: Phase = "prefill" if prefill_pairs > 0 else "decode"
        linear = self.linear_layer_ms(model, node, tp, phase, tokens)
        if linear is None:  # a measured table: whole layers at a token count
            ms = self.measured.get(model, self.catalog.node(node).id, phase).ms_at(tokens)  # type: ignore[union-attr]
            assert ms is not None  # callers cap sizes at the table's range
            return ms
        dec_lat, dec_ms, pre_lat, pre_ms = self.attention_terms(model, node, tp)
        attention = 0.0
        if decode_seqs:
            held = self.card(model).kv_tokens_held(decode_context)
            attention += dec_lat + decode_seqs * held * dec_ms
        if prefill_pairs:
            attention += pre_lat + prefill_pairs * pre_ms
        return linear + attention

    def linear_layer_ms(
        self, model: ModelId, node: str, tp: int, phase: Phase, tokens: int
    ) -> float | None:
        """One layer's work that scales with the step's tokens alone (weight GEMMs, elementwise
        kernels, TP all-reduces, the runtime's per-layer cost): the layer without attention,
        memoised. None where a measured table times the layer (it has no components)."""
        cfg = self.catalog.node(node)
        if self.measured.get(model, cfg.id, phase) is not None:
            return None
        key = (model, cfg.id, tp, phase, float(tokens), -1.0)
        linear = self._layer_memo.get(key)
        if linear is None:
            b = self._breakdown(self.card(model), cfg, tp, phase, tokens, 1.0)
            linear = b.ms - b.attention_ms
            if len(self._layer_memo) >= LAYER_MEMO_MAX:
                self._layer_memo.clear()
            self._layer_memo[key] = linear
        return linear

    def stage_fixed_ms(
        self, model: ModelId, node: str, tp: int, phase: Phase, tokens: int, layers: int, hop: bool
    ) -> float | None:
        """A pipeline stage's time for a step of `tokens` tokens less its attention: `layers`
        x `linear_layer_ms`, the step overhead, and the hop to the next stage if it has one,
        memoised. None where a measured table times the layer."""
        key = (model, node, tp, phase, tokens, layers, hop)
        if key in self._fixed_memo:
            return self._fixed_memo[key]
        linear = self.linear_layer_ms(model, node, tp, phase, tokens)
        fixed = None
        if linear is not None:
            fixed = self.stage_of_layers_ms(model, node, phase, tokens, layers, hop, linear)
        if len(self._fixed_memo) >= LAYER_MEMO_MAX:
            self._fixed_memo.clear()
        self._fixed_memo[key] = fixed
        return fixed

    def attention_terms(
        self, model: ModelId, node: str, tp: int
    ) -> tuple[float, float, float, float]:
        """Attention of one layer as (decode latency, ms per decode sequence per held token,
        prefill latency, ms per prefill pair), from the GPU's kernel factors."""
        card, cfg = self.card(model), self.catalog.node(node)
        k = self.calibration.kernels_for(cfg.gpu_id)
        kv_bytes = card.kv_bytes_per_token_per_layer / min(tp, card.kv_heads)
        bw = cfg.gpu.memory_bandwidth_gb_s * 1e9 * k.attention_decode_mem
        flops = 4 * card.attention_heads * card.head_dim / tp
        tf = cfg.gpu.dense_tflops * 1e12 * k.attention_prefill_compute
        return (
            k.attention_decode_latency_ms,
            kv_bytes / bw * 1e3,
            k.attention_prefill_latency_ms,
            flops / tf * 1e3,
        )

    def hop_ms(self, model: ModelId, node: str, tokens: float) -> float:
        """Sending `tokens` tokens' activations from `node` to the next pipeline stage, ms."""
        cfg = self.catalog.node(node)
        return hop_ms(self.card(model), tokens, cfg.network_gbps, self.settings)

    def _layer_ms(
        self,
        card: ModelCard,
        model: ModelId,
        cfg: NodeConfig,
        tp: int,
        phase: Phase,
        size: float,
        context: float,
    ) -> float:
        key = (model, cfg.id, tp, phase, size, context)
        cached = self._layer_memo.get(key)
        if cached is not None:
            return cached
        table = self.measured.get(model, cfg.id, phase)
        if table is not None:
            ms = table.ms_at(size)
            assert ms is not None  # callers cap size at the table's range
        else:
            ms = self._analytical(card, cfg, tp, phase, size, context).ms
        if len(self._layer_memo) >= LAYER_MEMO_MAX:
            self._layer_memo.clear()
        self._layer_memo[key] = ms
        return ms


def _largest_within(f: Callable[[int], float], budget_ms: float, max_size: int) -> int:
    """Largest integer size in [1, max_size] with f(size) <= budget (0 if none).

    Binary search: stage time grows with size (a property test checks it).
    """
    if max_size < 1 or f(1) > budget_ms:
        return 0
    lo, hi = 1, max_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= budget_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo
