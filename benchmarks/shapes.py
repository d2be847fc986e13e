"""Published models' shapes, as their config.json files give them, for benchmarks on random weights
(`--shape` of bench_decode.py and bench_gpu_train.py): widths, heads, head size, tied or not, theta, epsilon,
Llama 3's RoPE scaling, Qwen's q/k/v biases and padded vocabulary. The context is cut to 8192: it changes no
decoding step's work, and training takes its own (--context).
"""
from nanoeuler.model.config import Config

LLAMA3_SCALING = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}
SHAPES = {
    "smollm2-135m": Config(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden=1536, vocab_size=49152,
                           context=8192, mtp_heads=1, tied=True, rope_theta=100000.0, norm_eps=1e-5),
    "smollm2-1.7b": Config(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, hidden=8192, vocab_size=49152,
                           context=8192, mtp_heads=1, tied=True, rope_theta=130000.0, norm_eps=1e-5),
    "llama3.2-1b": Config(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden=8192, vocab_size=128256,
                          context=8192, mtp_heads=1, tied=True, rope_theta=500000.0, norm_eps=1e-5,
                          rope_scaling=LLAMA3_SCALING),
    "llama3-8b": Config(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336, vocab_size=128256,
                        context=8192, mtp_heads=1, rope_theta=500000.0, norm_eps=1e-5),
    "qwen2.5-0.5b": Config(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden=4864, vocab_size=151936,
                           context=8192, mtp_heads=1, tied=True, rope_theta=1000000.0, norm_eps=1e-6,
                           qkv_bias=True, tokenizer_vocab=151665, architecture="Qwen2ForCausalLM"),
}
