"""Model families, one folder each (target model, weight map, drafter pieces, engine format), and the registry."""
