"""python -m mlxdiff.serve: a local server over one loaded model, with OpenAI's images API, a job API with live
progress and previews (server-sent events), and a web page (docs/server.md)."""
