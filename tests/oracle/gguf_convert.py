#!/usr/bin/env python3
"""A memra checkpoint to GGUF by llama.cpp's own converter (convert_hf_to_gguf.py, with its gguf-py).

    python3 tests/oracle/gguf_convert.py LLAMA_CPP_SRC MODEL_DIR OUT_FILE OUTTYPE

LLAMA_CPP_SRC holds the converter (the llama.cpp vendored in the pinned llama-cpp-python's sdist:
tests/oracle/llamacpp_step35.py unpacks it for the oracles, scripts/gpu_deps.sh for the GPU peer). Needs
torch, numpy and transformers, not llama_cpp. The converter runs unmodified except for two things:
- its hparams come from config.json as written. The converter first tries transformers' AutoConfig and
  falls back to config.json only when that fails, which it does with the transformers llama.cpp pins
  (4.57.6, requirements-convert_legacy_llama.txt: no "step3p5" type). transformers >= 5 knows "step3p5"
  and normalises the config (pops `partial_rotary_factors`, the per-layer `rope_theta` list,
  `moe_layers_enum`, `attention_other_setting`; trims `layer_types` to the trunk), after which
  Step35Model fails with StopIteration in generate_extra_tensors (no full-attention partial rotary factor
  left) and would lose the sliding-window head count and the MoE layer list.
- the pre-tokenizer falls back to FALLBACK_PRE_TOKENIZER, only when its own detection gives up.
"""
import runpy
import sys

# The tiny checkpoints' BPE vocabulary is not the release one, so the converter's hash of a probe text's
# token ids matches no known model. The pre-tokenizer rules themselves are DeepSeek-V3's (tokenizer.json's
# three Split regexes equal llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM), the name llama.cpp records for
# Step-3.5/3.7 GGUFs.
FALLBACK_PRE_TOKENIZER = "deepseek-v3"


class RawConfigJson:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError("memra: use config.json as written (llama.cpp's pinned transformers has no step3p5)")


def main(argv):
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, model_dir, outfile, outtype = argv
    sys.path.insert(0, src)
    import conversion.base as base  # puts the vendored gguf-py ahead of any installed gguf

    base.AutoConfig = RawConfigJson
    detect = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return detect(self, tokenizer)
        except NotImplementedError:
            print(f"memra: BPE pre-tokenizer hash unknown, using {FALLBACK_PRE_TOKENIZER!r}", file=sys.stderr)
            return FALLBACK_PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = src + "/convert_hf_to_gguf.py"
    sys.argv = [script, model_dir, "--outfile", outfile, "--outtype", outtype]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
