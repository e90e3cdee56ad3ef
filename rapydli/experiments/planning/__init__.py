"""Layout planning: measuring a model, the step-time model, the network fit, the planner and the published figures it is checked against."""
