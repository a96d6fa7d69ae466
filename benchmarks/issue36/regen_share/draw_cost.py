"""What one sampled regeneration step's draw costs: 48 rows over SmolLM2's 49,152-token vocabulary (a softmax of
random logits at temperature 0.8), each row one float64 uniform, inverted through a float64 CDF over the whole
vocabulary (`draw_rows` before 2026-12-07) or in two levels (`inverse_cdf`); and the greedy argmax (`max`) each verify
forward took for every row before it was taken only when a row decodes greedily. Medians of 50, default threads.

    .venv/bin/python benchmarks/issue36/regen_share/draw_cost.py
"""

import statistics
import time

import torch

from angelspec_hf.generation.draft_round import inverse_cdf


def whole_cdf(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probabilities.double().cumsum(-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)


def median_ms(function, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


generator = torch.Generator().manual_seed(0)
logits = torch.randn(48, 1, 49152, generator=generator) * 3
probabilities = (logits[:, 0] / 0.8).softmax(-1)
uniforms = torch.rand(48, generator=generator, dtype=torch.float64)
assert torch.equal(whole_cdf(probabilities, uniforms), inverse_cdf(probabilities, uniforms))
print(f"float64 CDF over the vocabulary: {median_ms(lambda: whole_cdf(probabilities, uniforms)):.2f} ms")
print(f"two-level inverse_cdf:           {median_ms(lambda: inverse_cdf(probabilities, uniforms)):.2f} ms")
print(f"greedy max over the logits:      {median_ms(lambda: logits.max(-1).indices.tolist()):.2f} ms")
