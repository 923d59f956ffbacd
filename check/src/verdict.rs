//! The one verdict type of every record the project writes: a check's result, the
//! checker's judgement, a nemesis run, a control, a bench section (issue 20). Written as
//! `PASS`, `FAIL`, `ERROR` or `NOT_RUN`.
//!
//! Must not: decide a verdict (each producer does, by its own rule).

use serde::{Deserialize, Serialize};

/// The default is `NotRun`: nothing judged yet is never a pass.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Verdict {
    /// What was checked holds.
    #[serde(rename = "PASS")]
    Pass,
    /// What was checked does not hold (anomalies, a failed expectation, a missed target).
    #[serde(rename = "FAIL")]
    Fail,
    /// It could not be carried out or judged (the record says why); never a pass.
    #[serde(rename = "ERROR")]
    Error,
    /// Not run here, with the reason beside it (a missing facility, nothing to judge).
    #[default]
    #[serde(rename = "NOT_RUN")]
    NotRun,
}

impl Verdict {
    /// The word written in records.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Error => "ERROR",
            Verdict::NotRun => "NOT_RUN",
        }
    }

    /// `Pass` when `ok`, else `Fail`.
    pub fn of(ok: bool) -> Verdict {
        if ok {
            Verdict::Pass
        } else {
            Verdict::Fail
        }
    }

    pub fn is_pass(self) -> bool {
        self == Verdict::Pass
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A JSON value compares with a verdict by its written word (records read back as JSON).
impl PartialEq<Verdict> for serde_json::Value {
    fn eq(&self, v: &Verdict) -> bool {
        self.as_str() == Some(v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_as_its_word_and_read_back() {
        for v in [
            Verdict::Pass,
            Verdict::Fail,
            Verdict::Error,
            Verdict::NotRun,
        ] {
            let j = serde_json::to_value(v).unwrap();
            assert_eq!(j, serde_json::Value::from(v.as_str()));
            assert_eq!(j, v);
            assert_eq!(serde_json::from_value::<Verdict>(j).unwrap(), v);
            assert_eq!(v.to_string(), v.as_str());
        }
        assert!(serde_json::from_str::<Verdict>("\"pass\"").is_err());
    }

    #[test]
    fn of_and_is_pass_tell_a_pass_from_everything_else() {
        assert_eq!(Verdict::of(true), Verdict::Pass);
        assert_eq!(Verdict::of(false), Verdict::Fail);
        let passes: Vec<bool> = [
            Verdict::Pass,
            Verdict::Fail,
            Verdict::Error,
            Verdict::NotRun,
        ]
        .iter()
        .map(|v| v.is_pass())
        .collect();
        assert_eq!(passes, [true, false, false, false]);
        assert!(!Verdict::default().is_pass());
        // A record's word compares equal to its own verdict only.
        assert!(serde_json::json!("FAIL") != Verdict::Pass);
        assert!(serde_json::json!(null) != Verdict::NotRun);
    }
}
