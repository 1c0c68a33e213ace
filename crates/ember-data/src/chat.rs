//! Chat templates: how an instruction-tuned model lays a conversation out as text, a Jinja
//! template its tokenizer carries (`chat_template` in `tokenizer_config.json`, or
//! `chat_template.jinja` beside it). Rendered as transformers' `apply_chat_template` renders
//! it: blocks trimmed (`trim_blocks`, `lstrip_blocks`), `loop_controls`, Python's string methods,
//! and the same names: `messages`, `bos_token`, `eos_token`, `add_generation_prompt`,
//! `raise_exception(message)` and `strftime_now(format)` (today's date, UTC).

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::Serialize;
use serde_json::Value as Json;

use crate::error::{DataError, Result};

/// A tokenizer's settings file in a Hugging Face folder.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// Where transformers 4.43 and later save the chat template.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// What was said.
    pub content: String,
}

impl Message {
    /// A turn of `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template with the special tokens it is given.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The Jinja source.
    source: String,
    /// The file it came from, for errors.
    path: PathBuf,
    /// `bos_token`, `eos_token` (empty where the tokenizer has none).
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// The chat template of the Hugging Face folder `dir`: `chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template` (a text, or a list of named ones whose
    /// `default` is taken); `Ok(None)` where the folder has neither.
    pub fn of_folder(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config: Json = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| DataError::BadTokenizer {
                path: config_path.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(source) => {
                return Err(DataError::Read {
                    path: config_path,
                    source,
                });
            }
        };
        let token = |key: &str| match &config[key] {
            Json::String(s) => s.clone(),
            // An added token written whole: `{"content": "<s>", ...}`.
            other => other["content"].as_str().unwrap_or_default().to_string(),
        };
        let file = dir.join(CHAT_TEMPLATE_FILE);
        let (source, path) = if file.is_file() {
            let source = std::fs::read_to_string(&file).map_err(|source| DataError::Read {
                path: file.clone(),
                source,
            })?;
            (source, file)
        } else {
            let source = match &config["chat_template"] {
                Json::String(s) => s.clone(),
                Json::Array(named) => {
                    let default = named.iter().find(|t| t["name"] == "default");
                    match default
                        .or(named.first())
                        .and_then(|t| t["template"].as_str())
                    {
                        Some(s) => s.to_string(),
                        None => return Ok(None),
                    }
                }
                _ => return Ok(None),
            };
            (source, config_path)
        };
        Ok(Some(Self {
            source,
            path,
            bos: token("bos_token"),
            eos: token("eos_token"),
        }))
    }

    /// A template from its source, with the special tokens it is given (`path` names it in
    /// errors).
    pub fn new(source: &str, path: &Path, bos: &str, eos: &str) -> Self {
        Self {
            source: source.into(),
            path: path.into(),
            bos: bos.into(),
            eos: eos.into(),
        }
    }

    /// Writes the template as `chat_template.jinja` in `dir` and puts its special tokens in
    /// `settings` (`bos_token`, `eos_token`), which the caller writes as `tokenizer_config.json`:
    /// then [`Self::of_folder`] reads it back, and transformers too.
    pub fn save(&self, dir: &Path, settings: &mut Json) -> Result<()> {
        let path = dir.join(CHAT_TEMPLATE_FILE);
        std::fs::write(&path, &self.source).map_err(|source| DataError::Write { path, source })?;
        settings["bos_token"] = self.bos.clone().into();
        settings["eos_token"] = self.eos.clone().into();
        Ok(())
    }

    /// The token a turn ends with (`eos_token`), as the template is given it.
    pub fn eos_token(&self) -> &str {
        &self.eos
    }

    /// `messages` as the model reads them, followed by what opens the assistant's reply where
    /// `add_generation_prompt` (the prompt to continue).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let bad = |e: Error| {
            // The template's own `raise_exception` message stands alone.
            let message = match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or_default().to_string(),
                _ => e.to_string(),
            };
            DataError::BadTokenizer {
                path: self.path.clone(),
                message: format!("chat template: {message}"),
            }
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| {
            strftime(&format, now_utc())
        });
        env.add_template("chat", &self.source).map_err(bad)?;
        let template = env.get_template("chat").map_err(bad)?;
        template
            .render(context! {
                messages => messages,
                bos_token => self.bos,
                eos_token => self.eos,
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(bad)
    }
}

/// A moment in UTC: year, month (1-12), day, hour, minute, second.
type Utc = (i64, u32, u32, u32, u32, u32);

/// Now, from the system clock.
fn now_utc() -> Utc {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    civil(secs)
}

/// The moment `secs` seconds after 1970-01-01 00:00 UTC (days to a civil date by Howard
/// Hinnant's algorithm).
fn civil(secs: i64) -> Utc {
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400) as u32);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, rest / 3600, rest / 60 % 60, rest % 60)
}

/// `time` formatted as C's `strftime` formats it for the directives chat templates use (`%d`,
/// `%m`, `%Y`, `%y`, `%b`, `%B`, `%H`, `%M`, `%S`, `%%`); any other is kept as written.
fn strftime(format: &str, time: Utc) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let (year, month, day, hour, minute, second) = time;
    let name = MONTHS[(month as usize).clamp(1, 12) - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{hour:02}"),
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three templates, five conversations, with and without the generation prompt, rendered
    /// as transformers rendered them (`scripts/make-chat-fixture.py`): the same text, or the
    /// template's own `raise_exception` message.
    #[test]
    fn templates_render_as_transformers_renders_them() {
        let fixture: Json =
            serde_json::from_str(include_str!("../tests/fixtures/chat.json")).unwrap();
        let today = strftime("%d %b %Y", now_utc());
        let (bos, eos) = (&fixture["bos_token"], &fixture["eos_token"]);
        let cases = fixture["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 30);
        for (i, case) in cases.iter().enumerate() {
            let name = case["template"].as_str().unwrap();
            let source = fixture["templates"][name].as_str().unwrap();
            let template = ChatTemplate::new(
                source,
                Path::new(name),
                bos.as_str().unwrap(),
                eos.as_str().unwrap(),
            );
            let messages: Vec<Message> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let rendered = template.render(&messages, case["add_generation_prompt"] == true);
            match (&case["expected"], rendered) {
                (Json::String(want), Ok(got)) => {
                    assert_eq!(got, want.replace("{DATE}", &today), "case {i} ({name})")
                }
                (Json::Null, Err(e)) => {
                    let want = case["error"].as_str().unwrap();
                    assert!(e.to_string().ends_with(want), "case {i}: {e} for {want:?}");
                    assert!(e.to_string().contains(name), "case {i}: {e} names no file");
                }
                (want, got) => panic!("case {i} ({name}): {got:?}, want {want}"),
            }
        }
    }

    /// A folder's template: `tokenizer_config.json`'s text or its list's `default`, with the
    /// special tokens written as text or as whole added tokens; `chat_template.jinja` over
    /// both; none where neither is there; a config that is not JSON named.
    #[test]
    fn a_folder_gives_its_template() {
        let dir = std::env::temp_dir().join(format!("ember-chat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let say = |template: &ChatTemplate| {
            template
                .render(&[Message::new("user", "hi")], true)
                .unwrap()
        };
        assert!(ChatTemplate::of_folder(&dir).unwrap().is_none());
        let config = |json: Json| {
            std::fs::write(dir.join(TOKENIZER_CONFIG), json.to_string()).unwrap();
            ChatTemplate::of_folder(&dir).unwrap()
        };
        let text = config(serde_json::json!({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "special": true},
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        }))
        .unwrap();
        assert_eq!(
            (say(&text).as_str(), text.eos_token()),
            ("<s>hi</s>", "</s>")
        );
        let named = config(serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "plain {{ messages | length }}"},
            ],
        }))
        .unwrap();
        assert_eq!(say(&named), "plain 1");
        assert!(config(serde_json::json!({"bos_token": "<s>"})).is_none());
        std::fs::write(
            dir.join(CHAT_TEMPLATE_FILE),
            "file {{ add_generation_prompt }}",
        )
        .unwrap();
        // (A boolean prints as Python prints it, as in jinja2.)
        assert_eq!(
            say(&ChatTemplate::of_folder(&dir).unwrap().unwrap()),
            "file True"
        );
        std::fs::write(dir.join(TOKENIZER_CONFIG), "{ not json").unwrap();
        let err = ChatTemplate::of_folder(&dir).unwrap_err().to_string();
        assert!(err.contains(TOKENIZER_CONFIG), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn dates_format_as_strftime_does() {
        let time = (2024, 7, 26, 9, 5, 3);
        assert_eq!(strftime("%d %b %Y", time), "26 Jul 2024");
        assert_eq!(
            strftime("%B %d, %y %H:%M:%S %%", time),
            "July 26, 24 09:05:03 %"
        );
        // Days after 1970-01-01, counted by hand: 2000-03-01 is 11,017 (30 years of 365 days,
        // 7 leap days, then January and February 2000's 60); 2024-02-29 is 19,782.
        assert_eq!(civil(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(civil(11_017 * 86_400 + 3723), (2000, 3, 1, 1, 2, 3));
        assert_eq!(civil(19_782 * 86_400), (2024, 2, 29, 0, 0, 0));
        assert_eq!(civil(-1), (1969, 12, 31, 23, 59, 59));
    }
}
