"""Bundled example environments: `math_env:MathEnv` (single turn) and `calculator_env:CalculatorEnv`
(multi-turn, one tool). They are what the docs, the tests and the demo run."""
