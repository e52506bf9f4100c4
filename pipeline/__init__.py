"""The runtime: configuration, records, queues, the graph, GPU context, metrics and logging."""
