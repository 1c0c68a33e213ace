//! A readable printout of a model: its shape in one line, then the parameters of each part.

use burn::module::Module;

use crate::{DecoderOnly, EncoderDecoder};

/// Formats `n` with thousands separators: `818241 -> "818,241"`.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn row(out: &mut String, name: &str, params: usize) {
    out.push_str(&format!("  {name:<24} {:>14}\n", thousands(params)));
}

impl DecoderOnly {
    /// One row per component with its parameter count, and the total.
    pub fn summary(&self) -> String {
        let mut out = String::from("DecoderOnly\n");
        row(&mut out, "wte (token embedding)", self.wte.num_params());
        if let Some(wpe) = &self.wpe {
            row(&mut out, "wpe (positions)", wpe.num_params());
        }
        for (i, block) in self.blocks.iter().enumerate() {
            row(&mut out, &format!("blocks.{i}"), block.num_params());
        }
        row(&mut out, "ln_f", self.ln_f.num_params());
        match &self.lm_head {
            Some(head) => row(&mut out, "lm_head", head.num_params()),
            None => out.push_str("  lm_head                  tied to wte\n"),
        }
        out.push_str(&format!(
            "  total parameters {:>22}\n",
            thousands(self.num_params())
        ));
        out
    }
}

impl EncoderDecoder {
    /// One row per component with its parameter count, and the total.
    pub fn summary(&self) -> String {
        let mut out = String::from("EncoderDecoder\n");
        row(&mut out, "src_embed", self.src_embed.num_params());
        match &self.tgt_embed {
            Some(e) => row(&mut out, "tgt_embed", e.num_params()),
            None => out.push_str("  tgt_embed                shared with src_embed\n"),
        }
        for (i, block) in self.encoder.iter().enumerate() {
            row(&mut out, &format!("encoder.{i}"), block.num_params());
        }
        for (i, block) in self.decoder.iter().enumerate() {
            row(&mut out, &format!("decoder.{i}"), block.num_params());
        }
        match &self.output {
            Some(o) => row(&mut out, "output", o.num_params()),
            None => out.push_str("  output                   tied to the target embedding\n"),
        }
        out.push_str(&format!(
            "  total parameters {:>22}\n",
            thousands(self.num_params())
        ));
        out
    }
}
