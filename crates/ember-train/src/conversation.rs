//! What a model folder says of conversation beside its tokenizer, carried from the folder a run
//! starts from into its checkpoints and from there into a Hugging Face export.

use std::path::Path;

use ember_data::chat::ChatTemplate;

use crate::error::{Result, write_err};

/// What a model folder says of conversation beside its tokenizer: the chat template of an
/// instruction-tuned model, and the ids that end its texts. A run started from the folder keeps
/// them, so that its checkpoints chat (`ember generate --chat`) and stop where it did.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// The chat template, if the folder has one.
    pub template: Option<ChatTemplate>,
    /// `eos_token_id`s of its `generation_config.json` and `config.json`.
    pub end_ids: Vec<u32>,
}

impl Conversation {
    /// The folder `dir`'s (a Hugging Face folder or an ember checkpoint).
    pub fn of_folder(dir: &Path) -> Result<Self> {
        Ok(Self {
            template: ChatTemplate::of_folder(dir)?,
            end_ids: crate::hf::end_ids(dir)?,
        })
    }

    /// Writes it into the checkpoint (or Hugging Face) folder `dir`: `chat_template.jinja`,
    /// `tokenizer_config.json` (`settings` with the template's special tokens; not written when
    /// both are empty) and `generation_config.json`'s `eos_token_id`.
    pub fn save_with(&self, dir: &Path, mut settings: serde_json::Value) -> Result<()> {
        if let Some(template) = &self.template {
            template.save(dir, &mut settings)?;
        }
        if settings.as_object().is_some_and(|s| !s.is_empty()) {
            let path = dir.join(crate::hf::HF_TOKENIZER_CONFIG);
            std::fs::write(&path, settings.to_string()).map_err(|e| write_err(&path, e))?;
        }
        if !self.end_ids.is_empty() {
            let path = dir.join("generation_config.json");
            let text = serde_json::json!({"eos_token_id": self.end_ids}).to_string();
            std::fs::write(&path, text).map_err(|e| write_err(&path, e))?;
        }
        Ok(())
    }

    /// [`Self::save_with`] no other settings (an ember checkpoint).
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_with(dir, serde_json::json!({}))
    }
}
