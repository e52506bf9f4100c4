"""One module per stage of the graph: decode, preprocess, infer, postprocess, annotate, sinks."""
