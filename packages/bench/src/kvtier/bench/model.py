"""A small Llama-shaped model with random weights and a locally trained tokenizer.

kvtier's tests, ``kvtier demo`` and ``kvtier bench e2e`` run real vLLM without downloading
anything: the model is built here from a seed. Weights are drawn with a large init range (0.2) so
the output depends clearly on the context: loading the wrong KV changes the generation.

``architecture="gemma3"`` builds a Gemma 3 text model instead, its layers alternating
sliding-window (``sliding_window`` tokens) and full attention: a hybrid model that vLLM serves
with two KV cache groups; ``"gemma3-sliding"``: every layer sliding window (one group);
``"qwen3-next"``: Gated DeltaNet (linear attention, a recurrent state) and full attention
layers alternating, which vLLM serves with a Mamba group in "align" mode; ``"gemma4"``: Gemma
4's structure, five sliding-window layers to one full-attention layer (the last layer full),
with its real head sizes (window heads of 64, full-attention heads of 512), so vLLM gives the
window groups blocks 8x larger than the full-attention group's (pages of one size). Untied embeddings
keep the greedy output context-sensitive (with tied ones the last token's embedding dominates
and it repeats one token).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_TEXT = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "or has had not but first one their its new after who they have two been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made river system "
    "between under also family team game season north south east west during series war album "
    "company history government village population music film station house while church county "
    "water light energy market cache memory engine token layer model server storage network disk "
    "report document question answer section chapter table figure result method value number"
)
_WORDS = _TEXT.split()


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the random model (Llama architecture, bf16)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 3300
    max_position_embeddings: int = 4096
    init_range: float = 0.2
    seed: int = 0
    architecture: str = "llama"  # or "gemma3", "gemma3-sliding", "qwen3-next", "gemma4"
    sliding_window: int = 64  # gemma3 and gemma4 only

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def synthetic_text(rng: random.Random, num_words: int) -> str:
    """Sentence-like filler text over a fixed vocabulary (documents, questions, training text)."""
    out: list[str] = []
    while len(out) < num_words:
        n = rng.randint(6, 18)
        sentence = [rng.choice(_WORDS) for _ in range(n)]
        sentence[0] = sentence[0].capitalize()
        out.extend(sentence)
        out[-1] += "."
    return " ".join(out[:num_words])


def _train_tokenizer(path: Path, spec: ModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(spec.seed)
    corpus = [synthetic_text(rng, 200) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - 8,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(str(path))


def build_model(path: str | os.PathLike[str], spec: ModelSpec | None = None) -> Path:
    """Write the model and tokenizer into ``path`` unless a model of the same spec is there.

    Idempotent: a directory holding ``kvtier_model_spec.json`` equal to ``spec`` is reused.
    """
    import torch

    spec = spec or ModelSpec()
    path = Path(path)
    marker = path / "kvtier_model_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    path.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(path, spec)
    torch.manual_seed(spec.seed)
    model = _model(spec).bfloat16()
    model.save_pretrained(str(path), safe_serialization=True)
    # Written last: a half-built directory is rebuilt on the next call.
    marker.write_text(json.dumps(asdict(spec), sort_keys=True))
    return path


def _model(spec: ModelSpec) -> Any:
    """The random-weight transformers model of ``spec``."""
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_range,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if spec.architecture == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))
    if spec.architecture in ("gemma3", "gemma3-sliding"):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        kinds = ["sliding_attention", "full_attention"] * (spec.num_layers // 2 + 1)
        if spec.architecture == "gemma3-sliding":
            kinds = ["sliding_attention"] * spec.num_layers
        config = Gemma3TextConfig(
            **common,
            pad_token_id=2,
            sliding_window=spec.sliding_window,
            layer_types=kinds[: spec.num_layers],
            query_pre_attn_scalar=spec.head_size,
        )
        return Gemma3ForCausalLM(config)
    if spec.architecture == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # Gated DeltaNet and full attention alternating; the linear-attention head dims are
        # 128 (what vLLM CPU's kernels take); a small mixture of experts.
        qwen = Qwen3NextConfig(
            **common,
            pad_token_id=2,
            layer_types=["linear_attention", "full_attention"] * (spec.num_layers // 2),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
        )
        qwen.architectures = ["Qwen3NextForCausalLM"]
        return Qwen3NextForCausalLM(qwen)
    if spec.architecture == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        n = spec.num_layers
        kinds = [
            "full_attention" if i % 6 == 5 or i == n - 1 else "sliding_attention" for i in range(n)
        ]
        # Gemma 4's full-attention head size (transformers' typed signature lacks it).
        gemma4_heads: dict[str, Any] = {"global_head_dim": 512}
        gemma4 = Gemma4TextConfig(
            **common,
            pad_token_id=2,
            sliding_window=spec.sliding_window,
            layer_types=kinds,
            **gemma4_heads,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=spec.vocab_size,
            num_kv_shared_layers=0,
        )
        return Gemma4ForCausalLM(gemma4)
    raise ValueError(
        "ModelSpec.architecture must be 'llama', 'gemma3', 'gemma3-sliding', 'qwen3-next' or "
        "'gemma4', "
        f"got {spec.architecture!r}"
    )
