"""The OpenAI-compatible server: `build_app(async_llm, served_model_name, api_key)` and
`kvflow serve`. Imports FastAPI, so nothing in kvflow imports this package eagerly."""
