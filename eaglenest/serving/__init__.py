"""The drafter in serving engines (vLLM, SGLang): launch, check, and the command lines to serve it."""
