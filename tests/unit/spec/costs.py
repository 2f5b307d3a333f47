"""Hand-made step cost models for scheduler tests (the engine measures its own; these are exact)."""
from tide.spec.cost import StepCostModel


def linear_cost(max_rows: int, max_depth: int, per_token_s: float, draft_per_depth_s: float,
                base_s: float = 1.0) -> StepCostModel:
    """verify(B, q) = base + per_token * B * (q - 1); a packed verify of k drafts in all
    base + per_token * k; draft(B, d) = draft_per_depth * d; pinned (live steps of the tiny model
    do not move it)."""
    cost = StepCostModel(max_rows, max_depth, ewma=0.0)
    for rows in range(1, max_rows + 1):
        for tokens in range(1, max_depth + 2):
            cost.observe_verify(rows, tokens, base_s + per_token_s * rows * (tokens - 1), live=False)
        for drafts in range(rows * max_depth + 1):
            cost.observe_packed(rows, drafts, base_s + per_token_s * drafts, live=False)
        for depth in range(1, max_depth + 1):
            cost.observe_draft(rows, depth, max(1e-9, draft_per_depth_s * depth), live=False)
    return cost
