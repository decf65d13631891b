"""TensorStore, weight maps, IR validation and the compiler's plans, on small synthetic inputs."""
import json
import struct

import numpy as np
import pytest

from cpullm.graph import blocks
from cpullm.compile.compiler import compile_graph
from cpullm.errors import CheckpointError, WeightMapError
from cpullm.graph.ir import GraphBuilder, GraphError, Op
from cpullm.loading.tensors import TensorStore
from cpullm.loading.weightmap import ADD_ONE, W, WeightMap


def _write(path, tensors):
    """tensors: name -> (dtype string, np array of the stored bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_tensorstore_dtypes_and_shards(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    bf16 = (a.view(np.uint32) >> 16).astype(np.uint16)
    _write(tmp_path / "model-00001-of-00002.safetensors", {"a": ("F32", a), "b": ("F16", a.astype(np.float16))})
    _write(tmp_path / "model-00002-of-00002.safetensors", {"c": ("BF16", bf16)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    st = TensorStore(tmp_path)
    assert sorted(st.names()) == ["a", "b", "c"]
    for n in "abc":
        np.testing.assert_array_equal(st.get(n), a)
        assert st.get(n).dtype == np.float32
        out = np.full((4, 3), np.nan, np.float32)
        assert st.get(n, out=out[1:3]).base is out   # written into the given buffer
        np.testing.assert_array_equal(out[1:3], a)
        assert np.isnan(out[[0, 3]]).all()
    with pytest.raises(ValueError, match="out must be float32"):
        st.get("c", out=np.empty((3, 2), np.float32))
    assert st.raw("a").base is not None          # a view into the mapping, not a copy


def test_tensorstore_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing: x.safetensors"):
        TensorStore(tmp_path)


def test_tensorstore_overlap_and_size_mismatch(tmp_path):
    f = tmp_path / "model.safetensors"
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    hb = json.dumps(h).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(12))
    with pytest.raises(CheckpointError, match="overlap"):
        TensorStore(tmp_path)
    h = {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    hb = json.dumps(h).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(8))
    with pytest.raises(CheckpointError, match="needs 12 bytes"):
        TensorStore(tmp_path)


def test_no_safetensors_names_convert(tmp_path):
    with pytest.raises(CheckpointError, match="cpullm convert"):
        TensorStore(tmp_path)


class _Store:
    def __init__(self, tensors):
        self.t = tensors

    def names(self):
        return list(self.t)

    def shape(self, n):
        return self.t[n].shape

    def get(self, n):
        return self.t[n]


def test_weightmap_aliases_ignore_ties_and_transform_once():
    store = _Store({"language_model.model.norm.weight": np.zeros(4, np.float32),
                    "language_model.model.embed.weight": np.ones((3, 4), np.float32),
                    "vision_tower.x": np.zeros(1, np.float32)})
    wm = WeightMap(rules=[W("final_norm", "model.norm.weight", (4,), transform=ADD_ONE),
                          W("embed", "model.embed.weight", (3, 4)),
                          W("lm_head", None, (3, 4), tied_to="embed")],
                   aliases=[("language_model.model.", "model.")], ignore=[r"^vision_tower\."])
    r = wm.resolve(store)
    np.testing.assert_array_equal(r.get("final_norm"), np.ones(4))
    np.testing.assert_array_equal(r.get("final_norm"), np.ones(4))    # still once, not twice
    assert r.is_tied("lm_head") and r.ignored == ["vision_tower.x"]
    np.testing.assert_array_equal(r.get("lm_head"), r.get("embed"))


def test_weightmap_transform_must_keep_the_shape():
    from cpullm.loading.weightmap import Transform

    store = _Store({"model.w": np.ones((2, 3), np.float32)})
    flat = Transform("flatten", lambda w, args: w.reshape(-1))
    r = WeightMap(rules=[W("w", "model.w", (2, 3), transform=flat)]).resolve(store)
    with pytest.raises(WeightMapError, match=r"flatten turned model.w \(2, 3\) into \(6,\)"):
        r.get("w")


def test_weightmap_reports_everything_at_once():
    store = _Store({"model.a": np.zeros((2, 2), np.float32), "model.zzz": np.zeros(1, np.float32)})
    wm = WeightMap(rules=[W("a", "model.a", (3, 2)), W("b", "model.b", (2,)), W("layers.{i}.c", "model.l.{i}.c")],
                   n_layers=2)
    with pytest.raises(WeightMapError) as ei:
        wm.resolve(store)
    msg = str(ei.value)
    for part in ("model.b", "model.l.0.c", "model.l.1.c", "model.a: expected (3, 2)", "model.zzz"):
        assert part in msg


def test_graph_validate_catches_errors():
    g = GraphBuilder()
    x = blocks.embed(g, 8)
    g.add("bad", Op.ADD, [x, "nowhere"], width=8)
    h = g.begin_head("bad")
    with pytest.raises(GraphError, match="used before it is defined"):
        g.build(h)
    g = GraphBuilder()
    x = blocks.embed(g, 8)
    with pytest.raises(GraphError, match="no head"):
        g.build(x)


class _Weights:
    """ResolvedWeights stand-in: canonical name -> array."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __contains__(self, n):
        return n in self.arrays

    def source_of(self, n):
        return n

    def shape(self, n):
        return self.get(n).shape

    def get(self, n, out=None):
        arr = self.arrays[self.source_of(n)]
        if out is not None:
            out[...] = arr
            return out
        return arr


def _tiny_graph():
    g = GraphBuilder()
    H, V, I = 32, 50, 48
    spec = blocks.make_rope({"rope_type": "default", "rope_theta": 1e4}, 8)

    def mixer(g, i, x):
        return blocks.attention(g, i, x, hidden=H, n_heads=4, n_kv_heads=2, head_dim=8,
                                rope_spec=spec, scale=8 ** -0.5)

    def mlp(g, i, x):
        return blocks.glu_mlp(g, i, x, H, I, "silu")

    h = blocks.embed(g, H)
    for i in range(2):
        h = blocks.decoder_layer(g, i, h, mixer, mlp, 1e-5)
    graph = g.build(blocks.lm_head(g, h, V, 1e-5))
    rng = np.random.default_rng(0)
    shapes = {"embed": (V, H), "final_norm": (H,), "lm_head": (V, H)}
    for i in range(2):
        p = f"layers.{i}"
        shapes.update({f"{p}.attn_norm": (H,), f"{p}.mlp_norm": (H,), f"{p}.attn.q_proj": (32, H),
                       f"{p}.attn.k_proj": (16, H), f"{p}.attn.v_proj": (16, H), f"{p}.attn.o_proj": (H, 32),
                       f"{p}.mlp.gate_proj": (I, H), f"{p}.mlp.up_proj": (I, H), f"{p}.mlp.down_proj": (H, I)})
    return graph, _Weights({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()})


def test_compiler_fuses_qkv_and_gate_up():
    graph, w = _tiny_graph()
    prog = compile_graph(graph, w, quant="f32", n_ctx=64, max_chunk=8)
    names = prog.meta["names"]
    assert "layers.0.attn.q_proj+layers.0.attn.k_proj+layers.0.attn.v_proj" in names
    assert "layers.1.mlp.gate_proj+layers.1.mlp.up_proj" in names
    assert sum(1 for r in prog.I if r[0] == int(Op.LINEAR)) == 2 * 4 + 1


def test_compiler_live_buffers_never_overlap():
    """Replay the plan: at every instruction, the buffers it reads and writes are disjoint."""
    graph, w = _tiny_graph()
    prog = compile_graph(graph, w, quant="f32", n_ctx=64, max_chunk=8)
    assert prog.meta["arena_floats"] < sum(n.width for n in graph.nodes) * 8   # buffers are reused
    from cpullm.run.executor import Executor
    from steps import Steps
    ex = Steps(Executor(prog))
    ex.prefill([1, 2, 3, 4, 5])
    a = ex.prefill([6], all_logits=True)
    ex.reset()
    b = ex.prefill([1, 2, 3, 4, 5, 6], all_logits=True)[-1:]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tied_embedding_packed_once():
    graph, w = _tiny_graph()

    class Tied(_Weights):
        def source_of(self, n):
            return "embed" if n == "lm_head" else n
    prog = compile_graph(graph, Tied(w.arrays), quant="int8", n_ctx=64, max_chunk=8)
    untied = compile_graph(graph, w, quant="int8", n_ctx=64, max_chunk=8)
    assert prog.arrays["wq"].size < untied.arrays["wq"].size


class _ScriptedModel:
    """generate_ids returns fixed tokens; logits returns fixed last-position logits."""

    def __init__(self, tokens, last_logits):
        self.tokens, self.last_logits = tokens, np.asarray(last_logits, np.float32)

    def generate_ids(self, ids, **_):
        return iter(self.tokens)

    def logits(self, ids):
        return np.stack([self.last_logits] * len(ids))


def test_check_greedy_accepts_only_a_near_tie():
    from cpullm import testing

    reference = [3, 1, 2]
    assert testing.check_greedy(_ScriptedModel([3, 1, 2], [0, 0, 0, 0]), [0], reference) == [3, 1, 2]
    tie = [0.0, 5.0, 5.0 - 1e-5, 1.0]                       # tokens 1 and 2 within 2e-6 x max
    assert testing.check_greedy(_ScriptedModel([3, 2, 0], tie), [0], reference) == [3, 2, 0]
    clear = [0.0, 5.0, 4.0, 1.0]                            # token 1 beats token 2 by 0.2 x max
    with pytest.raises(AssertionError, match="from step 1.*not a tie"):
        testing.check_greedy(_ScriptedModel([3, 2, 0], clear), [0], reference)
    with pytest.raises(AssertionError, match="2 greedy tokens"):
        testing.check_greedy(_ScriptedModel([3, 1], clear), [0], reference)


# ---- one stored tensor, two canonical tensors -------------------------------------------------


def _tied_llama(tmp_path):
    import attrs as _attrs

    from cpullm.loading import plugins
    from cpullm.loading.family import read_config
    from cpullm.testing import make_random_checkpoint
    from cpullm.loading.weightmap import Transform
    from tiny_configs import SMOLLM2_LIKE

    cfg = dict(SMOLLM2_LIKE, model_type="llama", num_hidden_layers=2, tie_word_embeddings=True)
    d = make_random_checkpoint(cfg, tmp_path / "tied")
    fam = plugins.discover().family_for(cfg)
    args = fam.args(read_config(d))
    store = TensorStore(d)
    wmap = fam.weight_map(args)
    twice = Transform("twice", lambda w, args: w * np.float32(2.0))
    V, H = args.vocab_size, args.hidden_size
    rules = [W("lm_head", "model.embed_tokens.weight", (V, H), transform=twice)
             if r.canonical == "lm_head" else r for r in wmap.rules]
    doubled = _attrs.evolve(wmap, rules=rules).resolve(store, args)
    return d, fam.build_graph(args, GraphBuilder()), wmap.resolve(store, args), doubled


@pytest.mark.parametrize("quant", ["f32", "int8"])
def test_lm_head_declared_as_twice_the_embedding_gives_twice_the_logits(tmp_path, quant):
    """The embedding and a lm_head read from the same stored tensor with another transform are two
    matrices: packing by source alone made the lm_head the embedding (logit ratio 1.000)."""
    from cpullm.run.executor import Executor
    from steps import Steps

    _, graph, tied, doubled = _tied_llama(tmp_path)
    ids = [3, 14, 15, 92, 65, 35]
    logits = {}
    for name, weights in (("tied", tied), ("doubled", doubled)):
        ex = Steps(Executor(compile_graph(graph, weights, quant=quant, n_ctx=32, max_chunk=8)))
        logits[name] = ex.prefill(ids, all_logits=True)                         # (T, V)
    big = np.abs(logits["tied"]) > 1e-2 * np.abs(logits["tied"]).max()
    ratio = logits["doubled"][big] / logits["tied"][big]
    assert f"{ratio.min():.3f}" == f"{ratio.max():.3f}" == "2.000"


def test_tied_weights_with_one_transform_still_share_one_copy(tmp_path):
    _, graph, tied, doubled = _tied_llama(tmp_path)
    sizes = {name: compile_graph(graph, w, quant="int8", n_ctx=32, max_chunk=8).arrays["wq"].size
             for name, w in (("tied", tied), ("doubled", doubled))}
    V, H = tied.shape("embed")
    assert sizes["doubled"] - sizes["tied"] >= V * H         # the doubled lm_head is a second matrix
    prog = compile_graph(graph, tied, quant="int8", n_ctx=32, max_chunk=8)
    slots = prog.meta["weight_slots"]
    assert slots["lm_head"][:2] == slots["embed"][:2]        # one copy, read by both


def test_the_kit_catches_a_program_that_aliases_two_transforms(tmp_path):
    from cpullm import testing

    d, graph, _, doubled = _tied_llama(tmp_path)
    assert testing.compiled_weight_mismatches(graph, doubled) == []
    assert testing.check_compiled_weights(d)["checked"] > 0

    class SourceOnly:
        """A compiler input that keys tensors on their source alone (the old packing key)."""

        def __init__(self, w):
            self.w = w

        def __contains__(self, n):
            return n in self.w

        def identity(self, n):
            return self.w.identity(n)[0]

        def __getattr__(self, attr):
            return getattr(self.w, attr)

    assert testing.compiled_weight_mismatches(graph, SourceOnly(doubled)) == ["lm_head"]


def test_weight_rows_take_a_range_of_a_stored_tensor():
    fused = np.arange(24, dtype=np.float32).reshape(6, 4)           # (q 2 + k 2 + v 2, H 4)
    store = _Store({"qkv": fused})
    rules = [W("q", "qkv", (6, 4), rows=(0, 2)), W("k", "qkv", (6, 4), rows=(2, 4)),
             W("v", "qkv", (6, 4), rows=(4, 6), transform=ADD_ONE)]
    r = WeightMap(rules=rules).resolve(store)
    np.testing.assert_array_equal(r.get("k"), fused[2:4])
    np.testing.assert_array_equal(r.get("v"), fused[4:6] + 1)
    assert r.shape("q") == (2, 4) and r.identity("q") != r.identity("k")
    out = np.zeros((2, 4), np.float32)
    np.testing.assert_array_equal(r.get("q", out=out), fused[:2])
    with pytest.raises(WeightMapError, match=r"rows \(4, 8\) for v are outside its 6 rows"):
        WeightMap(rules=[W("v", "qkv", (6, 4), rows=(4, 8))]).resolve(store)


def test_args_ignore_a_config_key_that_names_a_derived_field():
    import attrs as _attrs

    from cpullm.loading.family import Args

    @_attrs.define
    class A(Args):
        hidden_size: int = 8
        head_dim: int = _attrs.field(init=False, default=0)     # derived only

        def derive(self, config):
            self.head_dim = self.hidden_size // 2

    a = A.from_config({"hidden_size": 16, "head_dim": 999, "unknown": 1})
    assert (a.hidden_size, a.head_dim) == (16, 8)
