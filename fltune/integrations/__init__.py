"""Integrations of fltune's frozen dispatch into serving engines (vLLM: ``integrations.vllm``)."""
