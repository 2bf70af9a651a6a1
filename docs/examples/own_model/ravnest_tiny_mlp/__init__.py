"""An example of a model of one's own for ravnest-node (docs/development.md, "Your own model")."""
