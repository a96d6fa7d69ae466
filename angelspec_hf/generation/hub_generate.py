"""Speculative decoding with an AngelSpec drafter, the Hub way (saved as `custom_generate/generate.py` in every
drafter folder):

    target.generate(input_ids, custom_generate="<drafter repo or folder>", trust_remote_code=True,
                    assistant_model="<the same repo or folder>", max_new_tokens=128)

`assistant_model` may also be a drafter already loaded. Its remote code routes `generate(assistant_model=...)` to
AngelSpec's draft-verify loop (D-cut choosing how deep to verify, one sequence or a batch), so no `angelspec_hf`
install is needed, and the output is the target's own: equal to plain greedy decoding, or drawn from the target's
distribution when sampling. transformers runs this file in its own module, without the drafter's files beside it,
so it imports only transformers.
"""

from transformers import AutoModel
from transformers.generation.utils import GenerationMixin


def generate(model, *args, assistant_model=None, **kwargs):
    """`model.generate(*args, assistant_model=drafter, **kwargs)` with the drafter loaded from its repo or folder
    (remote code trusted, as `custom_generate` already required) and moved to the target's device."""
    if assistant_model is None:
        raise ValueError(
            "This custom_generate runs speculative decoding with an AngelSpec drafter: pass "
            "assistant_model='<drafter repo or folder>' (or a loaded drafter) beside custom_generate"
        )
    if isinstance(assistant_model, str):
        assistant_model = AutoModel.from_pretrained(assistant_model, trust_remote_code=True)
    if not hasattr(assistant_model, "bind_target"):
        raise ValueError(
            f"assistant_model is a {type(assistant_model).__name__}, not an AngelSpec drafter; "
            "without custom_generate, transformers' own assisted generation takes it"
        )
    return GenerationMixin.generate(model, *args, assistant_model=assistant_model.to(model.device), **kwargs)
