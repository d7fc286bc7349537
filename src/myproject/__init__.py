"""myproject: your task's models and data sets. Edit, replace or add to them; the machinery is in scaleup."""
