"""The lean MiniLM pass (lean_bert.py) as an ONNX graph, run by onnxruntime on one thread.

Why: on CPUs where torch's float32 products are slow for this shape (a short text against
384x1152 weights: MKL's path on AVX2-only CPUs), onnxruntime's MLAS kernels run the whole pass
faster than the traced torch pass (docs/caching.md). Same weights, same float32
arithmetic: the vector is within cosine 0.99999 of sentence-transformers', checked at load by
`Embedder`.

The graph is built here from the weights (no export step, no file): embeddings + LayerNorm,
then per layer one fused QKV product, attention without a mask (one text, no padding), output
product + residual + LayerNorm, GELU MLP + residual + LayerNorm; the mean over tokens. Any
length up to the position table. `InferenceSession.run` releases the GIL for the whole pass,
as the traced torch call does.
"""

from __future__ import annotations

import numpy as np

from semantic_cache.lean_bert import float_weights, layer_weights, token_ids, unit

OPSET = 20  # LayerNormalization (17) and Gelu (20) as standard ops


def build_graph(bert) -> bytes:
    """A serialized ONNX model: int64 token ids (n,) -> the unnormalised mean-pooled vector."""
    from onnx import TensorProto, checker, helper, numpy_helper

    config = bert.config
    weights = float_weights(bert)
    hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
    nodes, initializers = [], []

    def tensor(name: str, value) -> str:
        array = value.numpy() if hasattr(value, "numpy") else value
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(kind: str, inputs: list[str], output: str, **attributes) -> str:
        nodes.append(helper.make_node(kind, inputs, [output], **attributes))
        return output

    def layer_norm(x: str, w, b, name: str) -> str:
        return op("LayerNormalization", [x, tensor(name + ".w", w), tensor(name + ".b", b)], name, epsilon=eps, axis=-1)

    def dense(x: str, w, b, name: str) -> str:
        return op("Add", [op("MatMul", [x, tensor(name + ".w", w)], name + ".mm"), tensor(name + ".b", b)], name)

    zero = tensor("zero", np.array([0], np.int64))
    n = op("Shape", ["ids"], "n")
    words = op("Gather", [tensor("word", weights["embeddings.word_embeddings.weight"]), "ids"], "words")
    positions = op("Slice", [tensor("position", weights["embeddings.position_embeddings.weight"]), zero, n, zero], "positions")
    x = op("Add", [op("Add", [words, positions], "emb.sum"),
                   tensor("token_type", weights["embeddings.token_type_embeddings.weight"][0])], "emb")
    x = layer_norm(x, weights["embeddings.LayerNorm.weight"], weights["embeddings.LayerNorm.bias"], "emb.ln")
    to_heads = tensor("to_heads", np.array([-1, 3, heads, hidden // heads], np.int64))
    to_rows = tensor("to_rows", np.array([-1, hidden], np.int64))
    scale = tensor("scale", np.array((hidden // heads) ** -0.5, np.float32))
    for i in range(config.num_hidden_layers):
        w, p = layer_weights(weights, i), f"l{i}."
        qkv = op("Transpose", [op("Reshape", [dense(x, w["qkv_w"], w["qkv_b"], p + "qkv"), to_heads], p + "qkv4")],
                 p + "qkvT", perm=[1, 2, 0, 3])  # (3, heads, n, head_dim)
        nodes.append(helper.make_node("Split", [qkv], [p + "q3", p + "k3", p + "v3"], axis=0, num_outputs=3))
        q, k, v = (op("Squeeze", [p + name + "3", zero], p + name) for name in "qkv")
        scores = op("Mul", [op("MatMul", [q, op("Transpose", [k], p + "kT", perm=[0, 2, 1])], p + "qk"), scale], p + "scores")
        attended = op("MatMul", [op("Softmax", [scores], p + "probs", axis=-1), v], p + "att")
        attended = op("Reshape", [op("Transpose", [attended], p + "attT", perm=[1, 0, 2]), to_rows], p + "att2")
        x = layer_norm(op("Add", [dense(attended, w["out_w"], w["out_b"], p + "out"), x], p + "res1"),
                       w["ln1_w"], w["ln1_b"], p + "ln1")
        up = op("Gelu", [dense(x, w["up_w"], w["up_b"], p + "up")], p + "gelu")
        x = layer_norm(op("Add", [dense(up, w["down_w"], w["down_b"], p + "down"), x], p + "res2"),
                       w["ln2_w"], w["ln2_b"], p + "ln2")
    op("ReduceMean", [x, zero], "vector", keepdims=0)
    graph = helper.make_graph(
        nodes, "lean_bert", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("vector", TensorProto.FLOAT, [hidden])], initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    checker.check_model(model)
    return model.SerializeToString()


class OnnxBertEncoder:
    """`LeanBertEncoder.embed` over an onnxruntime session."""

    def __init__(self, bert, tokenizer, max_length: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # One thread, the caller's: the embedder's own thread already serialises requests, and
        # a pool would spin on the cores the prefill needs.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: the optimizer's notes are not news
        self.session = ort.InferenceSession(build_graph(bert), options, providers=["CPUExecutionProvider"])
        self.tokenizer = tokenizer
        self.max_length = max_length

    def embed(self, text: str) -> np.ndarray:
        ids = np.asarray(token_ids(self.tokenizer, text, self.max_length), dtype=np.int64)
        return unit(self.session.run(None, {"ids": ids})[0])
