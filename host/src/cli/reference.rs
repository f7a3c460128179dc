//! The book's command-line and metrics reference pages, generated from the
//! clap definitions and the metrics registry, so that neither is written by
//! hand (`switchyard config reference --page cli|metrics`).

use clap::CommandFactory;

/// `docs/src/reference/cli.md`: every command, its arguments, their
/// defaults and environment variables, from the clap definitions.
#[must_use]
pub fn cli_markdown() -> String {
    let mut out = String::from(
        "# Command line\n\n\
         <!-- Generated from the clap definitions by `switchyard config reference --page cli`: do not edit. -->\n\n\
         `switchyard --help` and `switchyard COMMAND --help` print the same.\n",
    );
    let cli = super::Cli::command();
    global_options(&mut out, &cli);
    for command in cli.get_subcommands() {
        command_section(&mut out, "switchyard", command);
    }
    out
}

fn global_options(out: &mut String, cli: &clap::Command) {
    let rows = rows(cli.get_arguments().filter(|a| a.is_global_set()));
    if !rows.is_empty() {
        out.push_str("\nOptions every command takes:\n\n");
        out.push_str(&rows);
    }
}

fn command_section(out: &mut String, parent: &str, command: &clap::Command) {
    let path = format!("{parent} {}", command.get_name());
    let about = command
        .get_long_about()
        .or_else(|| command.get_about())
        .map(|a| one_line(&a.to_string()))
        .unwrap_or_default();
    out.push_str(&format!("\n## `{path}`\n\n{about}\n"));
    let rows = rows(
        command
            .get_arguments()
            .filter(|a| !a.is_global_set() && a.get_id() != "help"),
    );
    if !rows.is_empty() {
        out.push('\n');
        out.push_str(&rows);
    }
    for sub in command.get_subcommands() {
        command_section(out, &path, sub);
    }
}

fn rows<'a>(arguments: impl Iterator<Item = &'a clap::Arg>) -> String {
    let mut table = String::new();
    for arg in arguments {
        let name = match (arg.get_long(), arg.get_short()) {
            (Some(long), Some(short)) => format!("`--{long}`, `-{short}`"),
            (Some(long), None) => format!("`--{long}`"),
            (None, Some(short)) => format!("`-{short}`"),
            (None, None) => format!("`{}`", arg.get_id().as_str().to_uppercase()),
        };
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| format!("`{}`", v.to_string_lossy()))
            .collect();
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let possible: Vec<String> = if arg.get_action().takes_values() {
            arg.get_possible_values()
                .iter()
                .map(|v| format!("`{}`", v.get_name()))
                .collect()
        } else {
            Vec::new()
        };
        let mut help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(|h| one_line(&h.to_string()))
            .unwrap_or_default();
        if !possible.is_empty() {
            if !help.ends_with('.') {
                help.push('.');
            }
            help.push_str(&format!(" One of {}.", possible.join(", ")));
        }
        let need = if arg.is_required_set() { " (required)" } else { "" };
        table.push_str(&format!(
            "| {name}{need} | {} | {env} | {} |\n",
            defaults.join(", "),
            help.replace('|', "\\|")
        ));
    }
    if table.is_empty() {
        return table;
    }
    format!("| argument | default | environment | what it is |\n|---|---|---|---|\n{table}")
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `docs/src/reference/metrics-list.md`: every metric the relay registers,
/// its kind and help text, from the registry itself.
#[must_use]
pub fn metrics_markdown() -> String {
    let mut out = String::from(
        "# Metrics list\n\n\
         <!-- Generated from the metrics registry by `switchyard config reference --page metrics`: do not edit. -->\n\n\
         Every series the relay exports on `/metrics`, in registration order. Counters carry `_total` \
         after the name, histograms `_bucket`, `_sum` and `_count`. Each series' labels are on \
         [Metrics and health](metrics.md).\n\n\
         | metric | kind | what it counts |\n|---|---|---|\n",
    );
    for metric in crate::metrics::Metrics::new(None).described() {
        let name = if metric.kind == "counter" {
            format!("{}_total", metric.name)
        } else {
            metric.name.to_string()
        };
        out.push_str(&format!("| `{name}` | {} | {} |\n", metric.kind, metric.help));
    }
    out
}
