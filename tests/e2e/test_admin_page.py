"""The admin page (``/admin``, ``server/http/admin_page/``) in a real browser: headless Chromium
driven by Selenium over a real server with an admin key and its own control database. A wrong
admin key is refused with a message; the right one logs in; a project and a key are made through
the page, the key's value is shown once, serves a completion, and is gone from the page once
dismissed; the completion's tokens appear in the usage chart (by project, then by model), an
embedding request's under the embedding models' usage; every model's engine is listed; rate
and spend limits, and the models the project may use, are set through the page; the key revoked
through the page is refused (401); the project is archived; logging out forgets the admin key.
No Content-Security-Policy violation and no key value in the browser's console.

Skipped, saying what to install, without Debian's ``chromium`` and ``chromium-driver``
(``/usr/bin/chromium``, ``/usr/bin/chromedriver``; ``.ci/run`` installs them). Selenium is pointed
at that chromedriver, so selenium-manager never downloads one."""
from __future__ import annotations

import os
import time

import pytest

from tests.support.http import COMPLETIONS, MODEL, post, request
from tests.support.servers import running_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
if missing:
    pytest.skip(f"no {' or '.join(missing)}: install Debian's chromium and chromium-driver "
                "(`apt-get install chromium chromium-driver`)", allow_module_level=True)
pytest.importorskip("selenium", reason="no selenium: install the test extra (`pip install -e '.[test]'`)")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException, StaleElementReferenceException, TimeoutException)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

ADMIN = "admin-page-test-0123456789abcdef"  # 32 characters
KEY_STORE = "inference-server.admin-key"  # admin.js's sessionStorage item
ORG = "/v1/organization"
EMBED = "page-embed"


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory, model_path):
    """The bundled model for generation (the default) and again as an embedding model."""
    folder = tmp_path_factory.mktemp("control")
    (folder / "models.toml").write_text(
        f'[[models]]\nnames = ["{MODEL}"]\npath = "{model_path}"\nmax_slots = 2\nmax_seq_len = 256\n\n'
        f'[[models]]\nnames = ["{EMBED}"]\npath = "{model_path}"\nkind = "embed"\npooling = "mean"\nmax_slots = 4\n')
    with running_server("--models", str(folder / "models.toml"),
                        env={"ADMIN_KEYS": ADMIN, "CONTROL_DB": str(folder / "control.db")}) as s:
        yield s


@pytest.fixture
def browser(tmp_path):
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,2000", "--no-first-run", "--disable-extensions",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The admin page in ``driver``: elements by ``data-testid``, explicit waits."""

    def __init__(self, driver, timeout: float = 10.0):
        self.driver, self.timeout = driver, timeout

    def __call__(self, testid: str, within=None):
        return (within or self.driver).find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]')

    def until(self, check, what: str, timeout: float | None = None):
        """``check()``'s first true value; fails after ``timeout`` s naming ``what`` and the page's message."""
        try:
            return WebDriverWait(self.driver, timeout or self.timeout, poll_frequency=0.05,  # rows are redrawn
                                 ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                                 ).until(lambda d: check())
        except TimeoutException:
            raise AssertionError(f"no {what} within {timeout or self.timeout} s; the page says "
                                 f"{self('message').text!r}") from None

    def visible(self, testid: str) -> bool:
        return self(testid).is_displayed()

    def fill(self, testid: str, text: str) -> None:
        field = self(testid)
        field.clear()
        field.send_keys(text)

    def message(self) -> str:
        return self("message").text if self.visible("message") else ""

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)


def usage_total(page: Page, key: str):
    """The totals the page's usage chart shows for group ``key`` (None until it shows one)."""
    return page.js("const u = window.adminPageUsage;"
                   "return u ? (u.totals.find(t => t.key === arguments[0]) || null) : null;", key)


def completion(server, key: str, until: int):
    """A completion with ``key``, asked again (for up to 3 s) until its status is ``until``: a key
    revoked on one worker is refused by the others within the control plane's poll (0.5 s; a key
    made serves at once)."""
    deadline = time.monotonic() + 3
    while True:
        reply = post(server, COMPLETIONS, {"model": MODEL, "prompt": "Hello", "max_tokens": 5}, key=key)
        if reply.status == until or time.monotonic() > deadline:
            return reply
        time.sleep(0.05)


def admin_get(server, path: str, check) -> dict:
    """``GET /v1/organization<path>`` with the admin key, whose answer passes ``check`` (an admin
    read sees every change already answered, whichever worker takes it)."""
    reply = request(server, "GET", ORG + path, key=ADMIN)
    assert reply.status == 200 and check(reply.json()), (reply.status, reply.body)
    return reply.json()


def test_admin_page(admin_server, browser):
    server = admin_server
    started = time.monotonic()
    page = Page(browser)
    browser.get(server.url + "/admin")
    page.until(lambda: page.visible("login"), "the login form")

    # a wrong key: refused, said so, back at the login form, nothing kept
    page.fill("admin-key", "not-the-admin-key-0000000000")
    page("login-submit").click()
    page.until(lambda: "refused" in page.message(), "a refused key's message")
    assert "401" in page.message() and page.visible("login") and not page.visible("app")
    assert page.js("return sessionStorage.getItem(arguments[0])", KEY_STORE) is None

    # the admin key: the engine now
    page.fill("admin-key", ADMIN)
    page("login-submit").click()
    page.until(lambda: page.visible("app"), "the page after login")
    assert not page.visible("login") and ADMIN not in browser.current_url
    page.until(lambda: page("engine-ready").text == "yes", "the engine ready")
    assert page("engine-slots").text.endswith("of 2"), page("engine-slots").text  # the default model's, first
    embed_row = page.until(lambda: browser.find_element(By.CSS_SELECTOR, f'[data-model="{EMBED}"]'),
                           "the embedding model's engine")
    assert page("engine-kind", embed_row).text == "embeddings" and page("engine-kv", embed_row).text == "–"
    page.until(lambda: page("engine-ready", embed_row).text == "yes", "the embedding engine ready")

    # a project, made through the page
    page.fill("project-name", "page-test")
    Select(page("project-priority")).select_by_value("high")
    page.fill("project-weight", "2")
    page("project-create").click()
    page.until(lambda: page.visible("project-panel") and "page-test" in page("project-title").text,
               "the new project opened")
    row = page.until(lambda: browser.find_elements(By.CSS_SELECTOR, "#projects-table tr[data-project-id]"),
                     "the project listed")[0]
    project_id = row.get_attribute("data-project-id")
    assert project_id in page("project-title").text
    admin_get(server, f"/projects/{project_id}",
              lambda p: (p["name"], p["priority"], p["weight"]) == ("page-test", "high", 2))

    # a key: its value shown once, in the page only
    page.fill("key-name", "page-bot")
    page("key-create").click()
    page.until(lambda: page.visible("secret") and page("secret-value").text, "the new key's value")
    value = page("secret-value").text
    assert value.startswith("sk-proj-") and value not in browser.current_url
    key_row = page.until(lambda: browser.find_elements(By.CSS_SELECTOR, "#keys-table tr[data-key-id]"),
                         "the key listed")[0]
    key_id = key_row.get_attribute("data-key-id")
    assert value not in key_row.text and value[-4:] in key_row.text  # listed by its redacted value
    page("secret-dismiss").click()
    assert not page.visible("secret") and value not in browser.page_source

    # the key serves a completion (on the other worker once it has polled, within 0.5 s); its
    # tokens reach the chart
    reply = completion(server, value, until=200)
    assert reply.status == 200, reply.body
    usage = reply.json()["usage"]
    total = page.until(lambda: usage_total(page, project_id), "the completion's usage in the chart", timeout=15)
    assert (total["input_tokens"], total["output_tokens"], total["requests"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"], 1)
    charted = page.js("const c = Chart.getChart('usage-chart');"
                      "return c.data.datasets.map(d => [d.label, d.data.reduce((a, b) => a + b, 0)]);")
    assert [f"page-test ({project_id})", usage["total_tokens"]] in charted, charted
    usage_row = browser.find_element(By.CSS_SELECTOR, f'[data-testid="usage-row"][data-group="{project_id}"]')
    assert "page-test" in usage_row.text
    # by model: the same tokens under the served model's name
    Select(page("usage-group")).select_by_value("model")
    page.until(lambda: page.js("const u = window.adminPageUsage; return u && u.group === 'model' &&"
                               " u.totals.reduce((n, t) => n + t.input_tokens + t.output_tokens, 0);")
               == usage["total_tokens"], "the usage by model")
    # an embedding request: under the embeddings' usage, not the completions'
    embedded = post(server, "/v1/embeddings", {"model": EMBED, "input": ["one", "and two"]}, key=value)
    assert embedded.status == 200, embedded.body
    embedded = embedded.json()["usage"]["prompt_tokens"]
    Select(page("usage-api")).select_by_value("embeddings")
    page.until(lambda: page.js("const u = window.adminPageUsage; return u && u.api === 'embeddings' &&"
                               " u.totals.map(t => [t.key, t.input_tokens, t.output_tokens, t.requests]);")
               == [[EMBED, embedded, 0, 1]], "the embeddings' usage by model")
    Select(page("usage-api")).select_by_value("completions")
    page.until(lambda: page.js("const u = window.adminPageUsage; return u && u.api === 'completions' &&"
                               " u.totals.map(t => t.key);") == [MODEL], "the completions' usage alone")

    # rate limits and spend limit, set through the page
    page.fill("rate-rpd", "1000")
    page("rate-save").click()
    page.until(lambda: "Rate limits saved" in page.message(), "the rate limits saved")
    admin_get(server, f"/projects/{project_id}/rate_limits", lambda r: r["data"][0]["max_requests_per_1_day"] == 1000)
    page.fill("spend-amount", "5")
    page("spend-save").click()
    page.until(lambda: page("spend-limit").text == "$5.00", "the spend limit shown")
    admin_get(server, f"/projects/{project_id}/spend_limit", lambda r: r["threshold_amount"] == 500)
    assert page("spend-tokens").text == str(usage["total_tokens"] + embedded)  # the month's tokens, every model's
    page("spend-remove").click()
    page.until(lambda: page("spend-limit").text == "none", "the spend limit removed")
    # the models it may use: only the served model (by its alias), then every model again
    assert Select(page("models-mode")).first_selected_option.get_attribute("value") == ""  # every model
    Select(page("models-mode")).select_by_value("allow_list")
    page.fill("models-ids", MODEL)
    page("models-save").click()
    page.until(lambda: "Model permissions saved" in page.message(), "the model permissions saved")
    admin_get(server, f"/projects/{project_id}/model_permissions",
              lambda m: (m["mode"], m["model_ids"]) == ("allow_list", [MODEL]))
    Select(page("models-mode")).select_by_value("")
    page("models-save").click()
    page.until(lambda: page("models-ids").get_attribute("value") == "", "every model again")
    admin_get(server, f"/projects/{project_id}/model_permissions",
              lambda m: (m["mode"], m["model_ids"]) == ("deny_list", []))

    # revoked through the page (two clicks): refused at once here, within the poll on the other worker
    revoke = page("key-revoke", within=browser.find_element(By.CSS_SELECTOR, f'#keys-table tr[data-key-id="{key_id}"]'))
    revoke.click()
    revoke.click()
    page.until(lambda: "revoked" in page.message(), "the revocation")
    page.until(lambda: not browser.find_elements(By.CSS_SELECTOR, f'#keys-table tr[data-key-id="{key_id}"]'),
               "the key gone from the list")
    reply = completion(server, value, until=401)
    assert reply.status == 401 and reply.json()["error"]["code"] == "invalid_api_key", reply.body

    # archived through the page
    archive = page("project-archive", within=browser.find_element(
        By.CSS_SELECTOR, f'#projects-table tr[data-project-id="{project_id}"]'))
    archive.click()
    archive.click()
    page.until(lambda: "archived" in browser.find_element(
        By.CSS_SELECTOR, f'#projects-table tr[data-project-id="{project_id}"]').text, "the project archived")

    # logging out forgets the admin key
    page("logout").click()
    page.until(lambda: page.visible("login"), "the login form after logout")
    assert page.js("return sessionStorage.getItem(arguments[0])", KEY_STORE) is None
    assert not page.visible("app")

    logs = browser.get_log("browser")
    assert not [e for e in logs if "Content Security Policy" in e["message"]], logs
    assert not [e for e in logs if value in e["message"] or ADMIN in e["message"]], logs
    print(f"admin page test: {time.monotonic() - started:.1f} s after the server started")
