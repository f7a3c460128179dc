//! A real browser for the console's tests: Debian's chromium, headless,
//! driven through chromedriver (both installed by `scripts/services.sh`).
//! With `SWITCHYARD_SCREENSHOTS=DIR`, [`Browser::screenshot`] saves PNGs
//! there (the book's console page shows them).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};

/// A chromedriver process and one headless chromium session.
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    driver: Child,
    /// The browser's profile directory, which also names its processes.
    profile: std::path::PathBuf,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a session.
    ///
    /// # Panics
    /// When chromedriver or chromium is missing (run `scripts/services.sh start`).
    pub async fn start() -> Browser {
        let port = crate::free_port();
        let binary = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_string());
        let driver = Command::new(&binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {binary} ({e}); run scripts/services.sh start to install it")
            });
        let profile = std::env::temp_dir().join(format!("sy-chromium-{}", uuid::Uuid::new_v4().simple()));
        let mut options = serde_json::json!({
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000", "--hide-scrollbars", "--force-device-scale-factor=1",
                     "--disable-breakpad", "--disable-crash-reporter",
                     format!("--user-data-dir={}", profile.display())],
        });
        // Debian's /usr/bin/chromium is a wrapper script; the browser itself is here.
        let chromium = std::path::Path::new("/usr/lib/chromium/chromium");
        if chromium.is_file() {
            options["binary"] = chromium.display().to_string().into();
        }
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), options);
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&url)
                .await
            {
                Ok(client) => break client,
                Err(error) if Instant::now() < deadline => {
                    tracing::debug!(%error, "chromedriver not ready yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => panic!("no browser session from chromedriver at {url}: {error}"),
            }
        };
        Browser {
            client,
            driver,
            profile,
        }
    }

    /// Opens `url`.
    ///
    /// # Panics
    /// When the browser cannot.
    pub async fn open(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    /// The text of the first element `css` finds, if any.
    pub async fn text(&self, css: &str) -> Option<String> {
        let element = self.client.find(Locator::Css(css)).await.ok()?;
        element.text().await.ok()
    }

    /// How many elements `css` finds.
    pub async fn count(&self, css: &str) -> usize {
        self.client
            .find_all(Locator::Css(css))
            .await
            .map_or(0, |found| found.len())
    }

    /// Clicks the first element `css` finds.
    ///
    /// # Panics
    /// When there is none.
    pub async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Types `text` into the first element `css` finds.
    ///
    /// # Panics
    /// When there is none.
    pub async fn type_into(&self, css: &str, text: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
            .send_keys(text)
            .await
            .unwrap_or_else(|e| panic!("type into {css}: {e}"));
    }

    /// The page's HTML source as the browser holds it.
    ///
    /// # Panics
    /// When the browser cannot say.
    pub async fn source(&self) -> String {
        self.client.source().await.expect("page source")
    }

    /// Waits (up to `bound`) until the text of `css` satisfies `wanted`;
    /// returns it and how long it took.
    ///
    /// # Panics
    /// When it does not in time; the message holds the last text.
    pub async fn wait_text(
        &self,
        css: &str,
        bound: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> (String, Duration) {
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < bound {
            if let Some(text) = self.text(css).await {
                if wanted(&text) {
                    return (text, started.elapsed());
                }
                last = Some(text);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let page = self.client.source().await.unwrap_or_default();
        panic!("{css} did not show what was wanted within {bound:?}; last: {last:?}; the page:\n{page}");
    }

    /// Saves a screenshot as `NAME.png` in `SWITCHYARD_SCREENSHOTS`, when set.
    pub async fn screenshot(&self, name: &str) {
        let Ok(dir) = std::env::var("SWITCHYARD_SCREENSHOTS") else {
            return;
        };
        match self.client.screenshot().await {
            Ok(png) => {
                let path = std::path::Path::new(&dir).join(format!("{name}.png"));
                std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            }
            Err(error) => panic!("screenshot {name}: {error}"),
        }
    }

    /// Ends the session and chromedriver.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A failed test does not reach close(), and chromium leaves the
        // driver's process group: its processes are found by their profile.
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &self.profile.display().to_string()])
            .status();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
