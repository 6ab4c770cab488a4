"""Tables and figures from the metrics files the evaluate stages write."""
