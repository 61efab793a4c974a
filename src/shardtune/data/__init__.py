"""Documents to token blocks: files, formats, packing, document masks, the quickstart corpus."""
