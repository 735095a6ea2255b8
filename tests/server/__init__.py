"""Tests of the HTTP server: the OpenAI API, metrics, x-ray, tools, several API servers."""
