"""benchmarks/synth.py: synthetic checkpoints with the seed models' exact shapes.

Each seed model's scaled-down copy (every width / 16 but the Gated DeltaNet head dims, a few
layers, same structure) is written, loaded by ``cpullm.load`` in INT8 and f32 and run for a few
greedy steps; its f32 logits are compared with transformers' at every position of a 24-token
input (past the scaled sliding windows of 8). The full-size plans (no weights written) are checked against what the Hub's
checkpoints hold: parameter counts and, where known, shard sizes. The weight statistics, the
streaming writer's bounds, atomicity and the tokenizer are checked on small cases.
"""
import json
import math

import numpy as np
import pytest

pytestmark = pytest.mark.reference   # needs torch and transformers

import cpullm
from cpullm import testing
from cpullm.generate.chat import render_chat
from cpullm.loading.tensors import TensorStore
from bench_scripts import load_benchmark

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

synth = load_benchmark("synth")
MODELS = synth.model_names()
SCALE = 16
IDS_RNG = np.random.default_rng(11)


def test_the_seed_models_and_the_1b_benchmark_shape_are_there():
    assert MODELS == ["gemma-2-2b", "gemma-2b", "gemma-2b-it", "gemma-3-4b-it", "llama-3.2-1b", "llama-3.2-3b",
                      "qwen2.5-1.5b", "qwen3-1.7b", "qwen3.5-4b"]


# ---- scaled-down copies through cpullm and transformers --------------------------------------------

_BUILT = {}


def _tiny(name, tmp_path_factory):
    if name not in _BUILT:
        d = tmp_path_factory.mktemp("synth") / name
        summary = synth.write_checkpoint(name, d, scale=SCALE, seed=3, progress=False)
        _BUILT[name] = (d, summary)
    return _BUILT[name]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request, tmp_path_factory):
    return (request.param,) + _tiny(request.param, tmp_path_factory)


def _ids(d):
    vocab = json.loads((d / "config.json").read_text())
    vocab = vocab.get("text_config", vocab).get("vocab_size", 262208)
    bos = json.loads((d / "generation_config.json").read_text())["bos_token_id"]
    ids = [int(x) for x in IDS_RNG.integers(300, min(vocab, 100000), 24)]
    return ([bos] if bos is not None else []) + ids


def _hf_reference(d, config):
    cls = getattr(transformers, synth.load_seed(d.name)[1]["hf_class"])
    return cls.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()


def test_scaled_copy_runs_in_cpullm_int8_and_f32_and_matches_transformers(tiny):
    name, d, summary = tiny
    config = json.loads((d / "config.json").read_text())
    ids = _ids(d)
    f32 = cpullm.load(d, quant="f32", use_cache=False)
    logits = f32.logits(ids)                                              # (T, vocab)
    with torch.no_grad():
        ref = _hf_reference(d, config)(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    err = testing.check_parity(logits, ref)
    int8 = cpullm.load(d, quant="int8", use_cache=False)
    fid = testing.fidelity(int8.logits(ids), logits)
    assert fid["cosine"] >= 0.98, fid
    for model in (f32, int8):
        out = list(model.generate_ids(ids[:4], max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out) == 4 and all(0 <= t < logits.shape[1] for t in out)
    print(f"\n{name}: f32 parity {err:.1e}, int8 cosine {fid['cosine']:.4f} top1 {fid['top1']:.2f}")


def test_scaled_copy_keeps_the_structure(tiny):
    """Same tensor names as the full-size plan with the layers cut, same head counts, tying,
    special ids, Gated DeltaNet head dims; other widths divided."""
    name, d, _ = tiny
    full_cfg, layout = synth.load_seed(name)
    small_cfg = json.loads((d / "config.json").read_text())
    n_small = synth.text_section(small_cfg)["num_hidden_layers"]
    full = synth.tensor_plan(full_cfg, layout)
    keep = [n for n, _ in full if not _layer_index(n) or _layer_index(n) < n_small]
    store = TensorStore(d)
    stored = set(store.names())
    vision = ("vision", "visual")
    text_full = {n for n in keep if not any(v in n for v in vision)}
    text_small = {n for n in stored if not any(v in n for v in vision)}
    assert text_small == text_full
    for key in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "vocab_size",
                "final_logit_softcapping", "attn_logit_softcapping", "attention_bias",
                "linear_key_head_dim", "linear_value_head_dim"):        # see synth.scaled_config
        assert synth.text_section(small_cfg).get(key) == synth.text_section(full_cfg).get(key), key
    for key in ("eos_token_id", "bos_token_id", "image_token_index", "image_token_id"):
        assert small_cfg.get(key) == full_cfg.get(key), key


def _layer_index(name):
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "blocks") and parts[i + 1].isdigit() and "mtp" not in name:
            return int(parts[i + 1]) if "vision" not in name and "visual" not in name else None
    return None


CHAT_MARKERS = {"gemma": ("<start_of_turn>model\n", "<end_of_turn>"),
                "llama": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
                "qwen": ("<|im_start|>assistant\n", "<|im_end|>")}


def test_scaled_copy_chats_with_its_family_template(tiny):
    """`cpullm run --chat` needs a template, and generation must stop at the end of the turn."""
    name, d, _ = tiny
    model = cpullm.load(d, quant="int8")
    prompt, end_of_turn = next(v for k, v in CHAT_MARKERS.items() if name.startswith(k))
    text = render_chat(model, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi there"}])
    assert text.endswith(prompt) and "Hi there" in text and "Be brief." in text
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    assert model.tokenizer.decode(ids) == text
    assert model.tokenizer.token_to_id(end_of_turn) in model.eos_token_ids


# ---- full-size plans against the Hub ---------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_full_size_plan_matches_the_hubs_parameter_count_and_cpullms_weight_map(name):
    config, layout = synth.load_seed(name)
    plan = synth.tensor_plan(config, layout)
    params = sum(math.prod(s) for _, s in plan)
    if layout["hub_params"]:
        # the Hub shows the safetensors parameter count rounded to 3 significant digits
        assert f"{params / 1e9:.3g}B" == layout["hub_params"], params
    # every tensor cpullm's family asks for is in the plan, with its shape
    from cpullm.loading import plugins
    fam = plugins.discover().family_for(config)
    args = fam.args(config)
    names = dict(plan)
    aliases = [(a, b) for a, b in getattr(fam.weight_map(args), "aliases", [])]
    for rule in fam.weight_map(args).expand():
        if rule.source is None or rule.shape is None or rule.tied_to:
            continue
        candidates = [rule.source] + [a + rule.source[len(b):] for a, b in aliases
                                      if rule.source.startswith(b)]
        hit = [c for c in candidates if c in names]
        assert hit, f"{rule.source} not in the plan"
        assert math.prod(names[hit[0]]) == math.prod(rule.shape), (hit[0], names[hit[0]], rule.shape)


@pytest.mark.parametrize("name", [n for n in MODELS if synth.load_seed(n)[1]["hub_shard_bytes"]])
def test_full_size_shards_match_the_hubs_file_sizes(name):
    config, layout = synth.load_seed(name)
    plan = synth.tensor_plan(config, layout)
    shards = synth.shard_plan(plan, layout["hub_dtype"], layout["max_shard_bytes"])
    data = [sum(math.prod(s) for _, s in sh) * synth.DTYPE_BYTES[layout["hub_dtype"]] for sh in shards]
    assert len(data) == len(layout["hub_shard_bytes"])
    for ours, hub in zip(data, layout["hub_shard_bytes"]):
        assert 0 < hub - ours < 64 * 1024           # the Hub's file = tensor bytes + its JSON header


# ---- weight statistics -----------------------------------------------------------------------------

def _draw(stats, name, shape):
    return np.concatenate([c.reshape(-1) for c in stats.chunks(name, shape)]).reshape(shape)


def test_matrices_are_heavy_tailed_with_std_one_over_sqrt_fan_in():
    config, _ = synth.load_seed("llama-3.2-3b")
    stats = synth.WeightStats(config, seed=0)
    w = _draw(stats, "model.layers.0.mlp.down_proj.weight", (512, 8192))
    assert abs(w.std() * math.sqrt(8192) - 1) < 0.02
    kurt = float(((w - w.mean()) ** 4).mean() / w.var() ** 2)
    assert 4.3 < kurt < 5.6                           # 3 exp(4 * 0.35^2) = 4.9 in theory; Gaussian: 3


def test_norms_feeding_projections_carry_outlier_channels_at_trained_values():
    for name, offset in (("llama-3.2-3b", 1.0), ("gemma-2-2b", 0.0)):
        config, _ = synth.load_seed(name)
        H = synth.text_section(config)["hidden_size"]
        stats = synth.WeightStats(config, seed=0)
        mult = _draw(stats, "model.layers.4.input_layernorm.weight", (H,)) + (1.0 - offset)
        out = stats.outlier_channels
        assert len(out) == max(2, H // 512)
        rest = np.delete(mult, out)
        assert abs(rest.mean() - 1.0) < 0.02 and rest.std() < 0.15
        assert np.all(mult[out] >= 5.0 * 0.6) and np.all(mult[out] <= 20.0 * 1.5)
        # the same channels in another layer's pre-MLP norm (massive activations sit in fixed dims)
        pre_mlp = "pre_feedforward_layernorm" if name.startswith("gemma") else "post_attention_layernorm"
        other = _draw(stats, f"model.layers.9.{pre_mlp}.weight", (H,)) + (1.0 - offset)
        assert np.all(other[out] > 3.0)
        if name.startswith("gemma"):              # Gemma 2's post-attention norm is an output norm
            post = _draw(stats, "model.layers.9.post_attention_layernorm.weight", (H,)) + 1.0
            assert post.max() < 2.0


def test_embedding_rows_give_a_tied_head_realistic_logits():
    """On unit-RMS hidden states the tied head's logits have std ~2.5 and a top-1 logit well above
    the rest (the per-row log-normal scale); Gaussian rows of one scale would give ~4.4 std."""
    config, _ = synth.load_seed("qwen2.5-1.5b")
    stats = synth.WeightStats(config, seed=0)
    V, H = 151936, 1536
    E = _draw(stats, "model.embed_tokens.weight", (V, H))
    h = np.random.default_rng(1).standard_normal((8, H)).astype(np.float32)
    logits = h @ E.T                                                   # (8, V)
    std = logits.std(axis=1)
    top = np.sort(logits, axis=1)
    z = (top[:, -1] - logits.mean(axis=1)) / std
    assert np.all(np.abs(std - synth.EMBED_LOGIT_STD) < 0.4)
    assert np.median(z) > 6.0


def test_draws_are_deterministic_and_depend_on_seed_and_name():
    config, _ = synth.load_seed("qwen3-1.7b")
    a = synth.WeightStats(config, seed=5)
    b = synth.WeightStats(config, seed=5)
    c = synth.WeightStats(config, seed=6)
    name, shape = "model.layers.0.self_attn.q_proj.weight", (64, 2048)
    assert np.array_equal(_draw(a, name, shape), _draw(b, name, shape))
    assert not np.array_equal(_draw(a, name, shape), _draw(c, name, shape))
    assert not np.array_equal(_draw(a, name, shape), _draw(a, name.replace("q_proj", "k_proj"), shape))


def test_gated_delta_parameters_give_decays_below_one():
    config, _ = synth.load_seed("qwen3.5-4b")
    stats = synth.WeightStats(config, seed=0)
    A = np.exp(_draw(stats, "model.language_model.layers.0.linear_attn.A_log", (32,)))
    dt = np.log1p(np.exp(_draw(stats, "model.language_model.layers.0.linear_attn.dt_bias", (32,))))
    decay = np.exp(-A * dt)
    assert np.all((decay > 0.1) & (decay < 1.0))


def test_bf16_rounding_is_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 3.0e-3], np.float32)
    got = np.frombuffer(synth.to_bf16_bytes(x), np.uint16).astype(np.uint32) << 16
    ref = torch.tensor(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(got.view(np.float32), ref)


# ---- writer ----------------------------------------------------------------------------------------

def test_writer_streams_in_bounded_chunks(monkeypatch):
    config, _ = synth.load_seed("gemma-2b")
    monkeypatch.setattr(synth, "CHUNK_ELEMENTS", 1 << 16)
    stats = synth.WeightStats(config, seed=0)
    sizes = [c.size for c in stats.chunks("model.embed_tokens.weight", (1000, 2048))]
    assert max(sizes) <= 1 << 16 and sum(sizes) == 1000 * 2048 and len(sizes) > 10


def test_writer_never_overwrites_and_leaves_nothing_behind_on_failure(tmp_path, monkeypatch):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(synth.SynthError, match="never overwrites"):
        synth.write_checkpoint("qwen2.5-1.5b", out, scale=SCALE, progress=False)
    assert (out / "keep.txt").read_text() == "mine"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(synth, "write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        synth.write_checkpoint("qwen2.5-1.5b", tmp_path / "n", scale=SCALE, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_written_index_and_headers_agree(tiny):
    name, d, summary = tiny
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(files) >= 2 and files == sorted(summary["files"])
    index = json.loads((d / "model.safetensors.index.json").read_text())
    seen = {}
    for f in files:
        with open(d / f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__")
        assert {v["dtype"] for v in header.values()} == {"BF16"}
        seen.update({k: f for k in header})
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(
        math.prod(v) * 2 for v in _shapes(d).values())


def _shapes(d):
    out = {}
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h = json.loads(fh.read(n))
        out.update({k: v["shape"] for k, v in h.items() if k != "__metadata__"})
    return out


def test_tokenizer_has_the_vocab_size_and_the_special_ids(tiny):
    name, d, _ = tiny
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    config = json.loads((d / "config.json").read_text())
    V = synth.text_value(config, "vocab_size")
    assert tok.get_vocab_size(with_added_tokens=True) == V
    spec = synth.tokenizer_spec(synth.load_seed(name)[1])
    for text, i in spec["specials"].items():
        if i < V:
            assert tok.token_to_id(text) == i
    special = set(tok.get_added_tokens_decoder())
    last_plain = max(i for i in range(V - 300, V) if i not in special) if len(special) < V else None
    assert tok.decode([last_plain]).strip() != ""            # ids up to vocab_size decode to text
