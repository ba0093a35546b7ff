"""A server's identity against a run's (`rollout.identity`), on answers shaped as the worker
extension's `bapo_model_info`: shapes compared where both sides give them, and the weights by
fingerprint, from the files a server started from or from the model a run's push derives from.
Against real servers: test_pool.py (another model) and test_eval_server.py (tiny_pairs)."""

from __future__ import annotations

from bapo_cli.rollout.identity import ModelIdentity, mismatch, weights_mismatch

URL = "http://127.0.0.1:8001"
QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 260,
    "shape": {"hidden_size": 128, "num_hidden_layers": 2, "num_key_value_heads": 0},
}


def test_shapes_are_compared_where_both_sides_give_them() -> None:
    run = ModelIdentity(("Qwen2ForCausalLM",), 260, (("hidden_size", 128),))
    assert mismatch(URL, QWEN, run) is None
    assert mismatch(URL, QWEN, ModelIdentity(("Qwen2ForCausalLM",), 260)) is None
    assert mismatch(URL, QWEN, None) is None
    wide = ModelIdentity(
        ("Qwen2ForCausalLM",), 260, (("hidden_size", 256), ("num_hidden_layers", 2))
    )
    assert mismatch(URL, QWEN, wide) == (
        f"the server {URL} serves another model (Qwen2ForCausalLM, vocab 260, hidden_size 128) "
        "than the run's (Qwen2ForCausalLM, vocab 260, hidden_size 256); start it for this run's "
        "model (bapo serve with the same model overrides)"
    )


def test_weights_are_compared_by_fingerprint_of_what_the_server_holds() -> None:
    fresh = {"fingerprint": "aaaa", "source": "/models/tiny", "holds": None}
    assert weights_mismatch(URL, fresh, "aaaa", "/m/tiny") is None
    assert weights_mismatch(URL, fresh, "bbbb", "/m/tiny_pairs") == (
        f"the server {URL} holds other weights than model.path=/m/tiny_pairs (the weights of "
        "/models/tiny; fingerprint aaaa, the model's bbbb); start a server for this model (bapo "
        "serve with the same model overrides), or give the model the server serves"
    )
    # a run's push: its weights derive from the model the run started from, whatever it trained
    pushed = fresh | {"holds": {"run": "h:/runs/a", "version": 7, "base": "bbbb"}}
    assert weights_mismatch(URL, pushed, "bbbb", "/m/tiny_pairs") is None
    line = weights_mismatch(URL, pushed, "aaaa", "/m/tiny")
    assert line is not None and "(version 7 pushed by h:/runs/a; fingerprint bbbb," in line
    # either side unknown (no safetensors files, a push that named no model): config only
    assert weights_mismatch(URL, fresh, None, "/m/x") is None
    assert weights_mismatch(URL, fresh | {"fingerprint": None}, "bbbb", "/m/x") is None
    unnamed = fresh | {"holds": {"run": None, "version": 1, "base": None}}
    assert weights_mismatch(URL, unnamed, "bbbb", "/m/x") is None
