"""Step planning: which decodes and prefill chunks a step runs within its budget, the adaptive
budget that sizes it, and the flat batch built from the plan."""
