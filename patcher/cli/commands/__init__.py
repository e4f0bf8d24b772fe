"""Click commands, one module per command family. No logic beyond argument handling and rendering."""
