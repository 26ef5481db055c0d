"""fltune: measurement-driven selection of LLM op implementations (vllm-plugin-FL compatible).

Data flow, one direction: model config -> workload -> adjudication -> calibration DB ->
freeze -> manifest -> dispatch. See README.md.
"""
__version__ = "0.1.0"
