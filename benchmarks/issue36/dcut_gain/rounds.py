"""Round by round, what D-cut's ĝ is made of for a learned drafter (one row, greedy, as `trace.py` runs the prompts):
for each drafting round the saved fraction its cut promised (g, from calibrated confidences) and the one it got
(the same formula with the accepted count in place of the confidences), and per prompt what the drafting rounds
saved together, promised and got (1 - Σ t / Σ t_0), the rounds drafted and ĝ after the prompt. A promise below what the rounds get means the calibrator holds ĝ down; a
promise that matches but swings round to round means the average is noisy.

    .venv/bin/python benchmarks/issue36/dcut_gain/rounds.py dfly gsm8k_test 8 [--gain-window 5]
"""

from common import arguments, dcut_run

from angelspec_hf.generation import policies
from angelspec_hf.generation.policies import DCut
from angelspec_hf.generation.session import memory_of


ROUNDS = []  # per drafting round: [promised g, confidence sum of the cut, depth, accepted]


def instrument():
    """Wrap DCut so each drafting round's cut and outcome are recorded (`ROUNDS`)."""
    record_gain, observe = DCut._record_gain, DCut.observe

    def logged_gain(self, drafting, confidences, depths, draft_seconds):
        before = dict(self.estimates.drafting_gain)
        record_gain(self, drafting, confidences, depths, draft_seconds)
        rows = len(depths)
        if drafting.reads_backlog:
            steps = len(drafting.probabilities)
            draft_seconds = self.first_step_seconds() + max(0, steps - 1) * self.step_seconds
        width = self.widths[max(depths, default=0)]
        promised = sum(float(c[:d].sum()) for c, d in zip(confidences, depths))
        ROUNDS.append(
            {
                "promised": promised,
                "depth": max(depths, default=0),
                "seconds": draft_seconds + width,
                "no_draft": self.widths[0],
                "rows": rows,
                "exploring": self.exploring,
                "g_before": before.get(rows),
            }
        )

    def logged_observe(self, drafting, depths, accepted, rows):
        observe(self, drafting, depths, accepted, rows)
        if ROUNDS and "accepted" not in ROUNDS[-1]:
            ROUNDS[-1]["accepted"] = sum(accepted)

    DCut._record_gain, DCut.observe = logged_gain, logged_observe


def saved(rounds: list[dict], tokens: str) -> float:
    """1 - Σ t / Σ t_0 over `rounds`: the share of the time no-draft rounds would take for the same tokens that the
    rounds saved, with each round's drafts counted as promised (`tokens="promised"`) or as accepted."""
    spent = sum(r["seconds"] / r["no_draft"] for r in rounds)
    return 1 - spent / max(sum(1 + r.get(tokens, 0) / r["rows"] for r in rounds), 1e-9)


def main():
    parser = arguments()
    parser.add_argument(
        "--gain-window",
        type=int,
        default=policies.GAIN_WINDOW,
        help="ĝ's window, in no-draft rounds' worth (`GAIN_WINDOW`); the `_window5`/`_window20` files were measured "
        "before ĝ weighed rounds by their tokens, 5 then being the old average",
    )
    args = parser.parse_args()
    policies.GAIN_WINDOW = args.gain_window
    instrument()
    model, drafter, encoded, stop = dcut_run(args)
    print("prompt  rounds  drafted (explored)  promised  got  mean |promised g - got g|  g_hat after")
    for i, input_ids in enumerate(encoded):
        ROUNDS.clear()
        model.generate(input_ids, **stop, assistant_model=drafter)
        rounds = len(memory_of(drafter).stats.drafted)
        done = [r for r in ROUNDS if "accepted" in r or r["depth"] == 0]
        promised = [saved([r], "promised") for r in done]
        got = [saved([r], "accepted") for r in done]
        gain = memory_of(drafter).estimates.drafting_gain.get(1)
        print(
            f"{i:>6} {rounds:>6} {len(done):>6} ({sum(r['exploring'] for r in done):>3})      "
            f"{saved(done, 'promised'):+.3f}  {saved(done, 'accepted'):+.3f}  "
            f"{sum(abs(p - g) for p, g in zip(promised, got)) / max(len(done), 1):.3f}"
            f"        {'none' if gain is None else f'{gain:+.3f}'}",
            flush=True,
        )
        trail = " ".join(f"{p:+.2f}/{g:+.2f}{'*' if r['exploring'] else ''}" for p, g, r in zip(promised, got, done))
        print(f"        rounds (promised/got, * explored): {trail[:1500]}", flush=True)


if __name__ == "__main__":
    main()
