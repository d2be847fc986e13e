"""What the model is trained on: pretraining corpora as token windows (corpus), instruction examples for SFT
(instructions), preference pairs for DPO (preferences), the chat template they are rendered in (template; an
imported model's own Jinja template: jinja_template), the downloaders that fetch them (fetch, run by
data/get_*.sh), and the evaluation's multiple-choice items (mc_items; HellaSwag's in hellaswag)."""
