"""The EAGLE-3 drafter (docs/design.md: Drafter and training, Serving format): the model and its
serving format (`model`), training-time test (`ttt`), its attention kernel (`attention`), the fused
loss head (`fused_loss`) and the trainer (`train`). Nothing here imports extraction."""
