"""The front end: what runs in the caller's process.

`llm.LLM` (offline, synchronous) and `async_llm.AsyncLLM` (the server's) take prompts,
`processor` turns each into an `EngineCoreRequest` (tokens, sampling parameters, validation),
the request crosses to the EngineCore process through the seam (engine/seam.py: the wire types
and message kinds both processes share), and `output_processor` turns the core's
`EngineCoreOutputs` back into `RequestOutput`s (detokenized, stop strings, metrics).
"""
